// Hopper forward kernel, head dim 96, bf16 (sm_90a code; empty for other targets).
#include "sm90/fwd_launch.h"

FLASH_ATTN2_INSTANTIATE_FWD_SM90(96, kBFloat16)
