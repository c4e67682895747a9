"""The FP8 quantisation schemes of YALI's quantising fused op (yali::fused_allreduce_rmsnorm_quant's
`scheme`): static per-tensor, dynamic per-token, dynamic per-token-group."""
SCHEME_STATIC = 0
SCHEME_PER_TOKEN = 1
SCHEME_GROUP = 2
