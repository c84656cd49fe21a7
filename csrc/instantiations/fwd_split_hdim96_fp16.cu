// Split-KV forward (decode, KV caches), head dim 96, fp16: SM80 tensor cores, built for every target.
#include "sm80/fwd_split_launch.h"

FLASH_ATTN2_INSTANTIATE_FWD_SPLIT(96, kFloat16)
