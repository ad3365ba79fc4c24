"""Default sizes of the benchmark's workloads, per device (no torch here: ``run.py`` reads them without it)."""

# CPU sizes: the default run (7 rounds) takes a few minutes on 2 cores with one torch thread per measurement. On a CPU
# without native bf16/fp16 matmul instructions (AVX2 only, say) torch emulates bf16 and fp16 matmuls, 10-60x slower than
# fp32, so the mixed-precision workloads use small batches: the per-step costs the fork changes (autocast's weight
# casts, the optimizer step) then keep a visible share of the step instead of vanishing behind the matmuls. The fused
# workload (16-mixed) is a wide, thin-batched MLP whose step is dominated by AdamW, the part ``fused=True`` speeds up.
# The many-parameter workload is 500 tiny layers (1,000 parameter tensors) whose every op is dispatch-bound, so any
# per-parameter work shows.
DEFAULT_SIZES = {
    "cpu": {
        "mlp_width": 512, "mlp_depth": 4, "mlp_batch": 32,
        "tied_width": 512, "tied_repeats": 8, "tied_batch": 4,
        "rnn_hidden": 512, "rnn_steps": 16, "rnn_batch": 2,
        "fused_width": 1024, "fused_depth": 2, "fused_batch": 4,
        "many_width": 8, "many_layers": 500, "many_batch": 16,
    },
    # On a GPU the same shapes would measure only kernel launches; these keep each step in the milliseconds.
    "cuda": {
        "mlp_width": 4096, "mlp_depth": 4, "mlp_batch": 1024,
        "tied_width": 4096, "tied_repeats": 8, "tied_batch": 256,
        "rnn_hidden": 2048, "rnn_steps": 32, "rnn_batch": 128,
        "fused_width": 4096, "fused_depth": 8, "fused_batch": 64,
        "many_width": 64, "many_layers": 500, "many_batch": 256,
    },
}
