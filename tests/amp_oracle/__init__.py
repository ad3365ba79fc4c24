"""The oracle: every "Lightning equals PyTorch's AMP recipe" comparison of the repository goes through this package.

A check trains the same tiny model on the same data twice, once through Lightning and once through PyTorch's AMP
recipe written by hand, and compares the two :class:`~amp_oracle.run.Run` s bit for bit.

* :mod:`amp_oracle.world`: what both sides share (sizes, loss scales, clip values, the scaler, the batches, the nets,
  the optimizers, the ``inf`` injection); :mod:`amp_oracle.torch_features`: what the installed torch can do;
* :mod:`amp_oracle.run`: the result type, the one comparison, the recipe's side (:class:`~amp_oracle.run.RecipeRun`);
* :mod:`amp_oracle.loops`: the recipe loops and the matching ``training_step`` bodies;
* the drivers, each returning a ``Run``: :mod:`amp_oracle.trainer` (the Trainer, on the CPU or a device),
  :mod:`amp_oracle.fabric`, :mod:`amp_oracle.ddp` (two processes); :mod:`amp_oracle.fused` adds the fused optimizers'
  cells (gradients and optimizer state recorded, a tolerance where fused kernels round differently);
* :mod:`amp_oracle.scenarios`: the scenario table (a user's loop, its recipe, and what each package must do).

Its users: the behaviour tests, ``make gpu-check`` (``benchmarks/gpu_check_parts.py``), ``benchmarks/count_calls.py``
and the demo (``examples/amp_demo.py``). The reproductions under ``upstream/issues/repro/`` and
``upstream/rfcs/repro/`` stay standalone on purpose: Lightning's maintainers run them with nothing but a Lightning and
a torch installed, against stock 2.6.6 and master, where this package does not exist.
"""
