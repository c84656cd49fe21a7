// Hopper forward kernel, head dims (192, 128) (Q / K, V / O: MLA, DeepSeek-V3), fp16 (sm_90a code; empty for other targets).
#include "sm90/fwd_launch.h"

FLASH_ATTN2_INSTANTIATE_FWD_SM90_PAIR(192, 128, kFloat16)
