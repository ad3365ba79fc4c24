"""Fabric's ``FSDPPrecision`` with FSDP's ``ShardedGradScaler`` on two gloo ranks, one of which holds no gradient for an
optimizer in the first iteration.

``ShardedGradScaler.unscale_`` all-reduces the inf check of each optimizer, so both ranks must unscale every optimizer,
in the same order, with gradients or not; otherwise an all-reduce is left unpaired (a hang, then gloo's timeout), or
the ranks' scales drift apart. Each rank trains through the plugin and, beside it, through the recipe written by hand
with its own ``ShardedGradScaler``; both must agree bitwise, and the ranks must see the same scales.
"""

import copy
import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from amp_oracle.torch_features import requires_cpu_grad_scaler
from torch import nn

pytestmark = requires_cpu_grad_scaler
class _Wrapper:  # what `fabric.setup` wraps an optimizer in, as far as the plugin sees it
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


X, Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(8, 2)


def _rank(rank: int, port: int, out: str, clipped: int) -> None:
    import torch.distributed as dist
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=url, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    nets = [nn.Linear(4, 2), nn.Linear(4, 2)]
    twins = copy.deepcopy(nets)
    opts = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for net in nets]
    twin_opts = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for net in twins]

    def new_scaler() -> ShardedGradScaler:
        return ShardedGradScaler(device="cpu", init_scale=2.0**4, growth_interval=1)

    plugin = FSDPPrecision("16-mixed", scaler=new_scaler())
    for opt in opts:
        plugin.track_optimizer_wrapper(_Wrapper(opt))  # what `fabric.setup` does
    scaler = new_scaler()

    def loss_of(models: list, i: int) -> torch.Tensor:
        # rank 1 holds no gradient for the second optimizer in the first iteration, where rank 0's gradients of it
        # overflow (only its): each rank must skip the second optimizer's step and not the first's; rank 0 overflows
        # entirely in the second iteration
        if rank == 1 and i == 0:
            return nn.functional.mse_loss(models[0](X), Y)
        first, second = (nn.functional.mse_loss(m(X), Y) for m in models)
        loss = first + (second * float("inf") if i == 0 else second)
        return loss * float("inf") if rank == 0 and i == 1 else loss

    scales, equal = [], []
    for i in range(4):
        plugin.backward(loss_of(nets, i), None)
        # clipping the first, or both with the second first: rank 1 has no gradient for the second in the first
        # iteration, and still unscales it at its clipping (or its step), or its all-reduce would pair with the other
        # rank's of the first optimizer
        for opt, net in reversed(list(zip(opts, nets))[:clipped]):
            plugin.unscale_gradients(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        for opt in opts:
            plugin.optimizer_step(opt)
            opt.zero_grad()
        # the recipe by hand: every rank unscales every optimizer, in order, then one update
        scaler.scale(loss_of(twins, i)).backward()
        for opt, twin in reversed(list(zip(twin_opts, twins))[:clipped]):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
        for opt in twin_opts:
            scaler.step(opt)
            opt.zero_grad()
        scaler.update()
        scales.append(plugin.scaler.get_scale())
        equal.append(
            plugin.scaler.get_scale() == scaler.get_scale()
            and all(torch.equal(p, q) for net, twin in zip(nets, twins) for p, q in zip(net.parameters(), twin.parameters()))
        )
    Path(out).write_text(json.dumps({"scales": scales, "equal": equal}))
    dist.destroy_process_group()


@pytest.mark.parametrize("clipped", [1, 2], ids=["first-clipped", "both-clipped"])
def test_two_ranks_one_without_gradients_stay_paired_and_follow_the_recipe(tmp_path, clipped):
    """Clipped or not, the optimizer without gradients on rank 1 is unscaled there too: at its clipping, or at its
    step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = str(Path(__file__).parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH"))))}
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    ranks = [
        subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(out), str(clipped)], env=env)
        for rank, out in enumerate(outs)
    ]
    assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    results = [json.loads(out.read_text()) for out in outs]
    assert results[0]["scales"] == results[1]["scales"] == [8.0, 4.0, 8.0, 16.0]  # rank 0's infs back off both
    assert results[0]["equal"] == results[1]["equal"] == [True] * 4


if __name__ == "__main__":  # a rank of the test above, started by it
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
