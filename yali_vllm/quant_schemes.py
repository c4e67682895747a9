"""The FP8 quantisation schemes of YALI's quantising fused op (yali::fused_allreduce_rmsnorm_quant)."""

SCHEME_STATIC = 0
SCHEME_PER_TOKEN = 1
SCHEME_GROUP = 2
