# Emulate an AVX2-only CPU on an AVX-512 machine: vLLM's CPU platform picks its _C_AVX2 kernels, ATen and oneDNN
# are capped by ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 (set in the environment).
import torch.cpu
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
