// Hopper backward kernel, head dim 192, bf16 (sm_90a code; empty for other targets).
#include "sm90/bwd_launch.h"

FLASH_ATTN2_INSTANTIATE_BWD_SM90(192, kBFloat16)
