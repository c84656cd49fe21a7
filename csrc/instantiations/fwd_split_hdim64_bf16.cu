// Split-KV forward (decode, KV caches), head dim 64, bf16: SM80 tensor cores, built for every target.
#include "sm80/fwd_split_launch.h"

FLASH_ATTN2_INSTANTIATE_FWD_SPLIT(64, kBFloat16)
