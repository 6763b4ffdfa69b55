"""Quantized expert formats: ggml's block layouts (Q8_0, Q4_0, Q4_K, Q6_K ...) as moescope's own."""
