// Hopper backward kernel, head dim 96, bf16 (sm_90a code; empty for other targets).
#include "sm90/bwd_launch.h"

FLASH_ATTN2_INSTANTIATE_BWD_SM90(96, kBFloat16)
