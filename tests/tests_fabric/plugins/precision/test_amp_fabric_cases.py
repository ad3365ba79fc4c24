"""Fabric loops that the differential cells did not have, each against PyTorch's recipe written by hand with torch's
own ``GradScaler``: weights and gradients bitwise, and the scale."""

import copy

import pytest
import torch
from amp_oracle.fabric import make_fabric
from amp_oracle.torch_features import requires_cpu_16_mixed
from amp_oracle.world import new_scaler
from torch import nn

pytestmark = requires_cpu_16_mixed

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))


def _nets(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 4) for _ in range(n)]


def _loss(*nets: nn.Module) -> torch.Tensor:
    return sum(net(X).float().pow(2).mean() for net in nets)


class _Both:
    """``n`` networks with SGD twice: through Fabric, and through torch's scaler by hand."""

    def __init__(self, n: int) -> None:
        nets = _nets(n)
        self.twins = copy.deepcopy(nets)
        self.fabric = make_fabric("16-mixed", scaler=new_scaler())
        self.models, self.opts = [], []
        for net in nets:
            model, opt = self.fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            self.models.append(model)
            self.opts.append(opt)
        self.twin_opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in self.twins]
        self.scaler = new_scaler()

    @property
    def recipe(self):
        return self.fabric.strategy.precision._recipe

    def backward(self, *which: int) -> None:
        with self.fabric.autocast():
            loss = _loss(*(self.models[i] for i in which))
        self.fabric.backward(loss)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(*(self.twins[i] for i in which))
        self.scaler.scale(loss).backward()

    def assert_same(self) -> None:
        for model, twin in zip(self.models, self.twins):
            for p, q in zip(model.parameters(), twin.parameters()):
                assert torch.equal(p, q)
                assert (p.grad is None) == (q.grad is None)
                if p.grad is not None:
                    assert torch.equal(p.grad, q.grad)


def test_clip_after_the_step_changes_nothing_and_updates_once():
    both = _Both(1)
    for _ in range(8):
        both.opts[0].zero_grad()
        both.twin_opts[0].zero_grad()
        both.backward(0)
        both.opts[0].step()
        norm = both.fabric.clip_gradients(both.models[0], both.opts[0], max_norm=1e6, error_if_nonfinite=False)
        both.scaler.step(both.twin_opts[0])
        both.scaler.update()
        expected = torch.nn.utils.clip_grad_norm_(both.twins[0].parameters(), 1e6)
        assert float(norm) == pytest.approx(float(expected))
        both.assert_same()
        assert both.fabric.strategy.precision.scaler.get_scale() == both.scaler.get_scale()
    assert both.recipe.updates == 8


def test_each_model_clipped_after_its_own_backward_then_both_step():
    """``fabric.backward`` then ``fabric.clip_gradients`` for each of two models, then both optimizers step:
    the recipe (torch unscales each once, the update after both steps), no error."""
    both = _Both(2)
    for _ in range(4):
        for opt, twin_opt in zip(both.opts, both.twin_opts):
            opt.zero_grad()
            twin_opt.zero_grad()
        for i in range(2):
            both.backward(i)
            both.fabric.clip_gradients(both.models[i], both.opts[i], max_norm=0.05)
            both.scaler.unscale_(both.twin_opts[i])
            torch.nn.utils.clip_grad_norm_(both.twins[i].parameters(), 0.05)
        for opt, twin_opt in zip(both.opts, both.twin_opts):
            opt.step()
            both.scaler.step(twin_opt)
        both.scaler.update()
        both.assert_same()
        assert both.fabric.strategy.precision.scaler.get_scale() == both.scaler.get_scale()


def test_a_backward_onto_an_optimizer_that_has_not_stepped_waits_for_its_step():
    """``backward`` reaching A and B, ``A.step()``, ``backward`` reaching B again, ``B.step()``: B's
    accumulated gradients carry one scale; the update follows B's step."""
    both = _Both(2)
    both.backward(0, 1)
    both.opts[0].step()
    both.scaler.step(both.twin_opts[0])
    both.backward(1)
    both.opts[1].step()
    both.scaler.step(both.twin_opts[1])
    both.scaler.update()
    both.assert_same()
    assert both.fabric.strategy.precision.scaler.get_scale() == both.scaler.get_scale()


def test_a_clip_without_a_step_does_not_update_before_the_next_backward():
    """``backward(model 1)``, ``clip_gradients(opt 1)``, ``backward(model 0)``, ``opt 1.step()``,
    ``opt 0.step()``: legal in torch, no error, the recipe's weights."""
    both = _Both(2)
    both.backward(1)
    both.fabric.clip_gradients(both.models[1], both.opts[1], max_norm=0.05)
    both.scaler.unscale_(both.twin_opts[1])
    torch.nn.utils.clip_grad_norm_(both.twins[1].parameters(), 0.05)
    both.backward(0)
    for i in (1, 0):
        both.opts[i].step()
        both.scaler.step(both.twin_opts[i])
    both.scaler.update()
    both.assert_same()
    assert both.fabric.strategy.precision.scaler.get_scale() == both.scaler.get_scale()


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 4, sparse=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embedding(idx).float().pow(2).mean()


def test_sparse_gradients_unscaled_then_a_backward_that_does_not_reach_them():
    """``nn.Embedding(sparse=True)``: unscale A, a backward that does not reach A, then both step.
    Legal in torch; nothing reads the values of A's sparse gradients (``ne`` has no sparse kernel)."""
    idx = torch.tensor([1, 2, 3])
    sparse, dense = _Sparse(), _nets(1)[0]
    twins = copy.deepcopy([sparse, dense])
    fabric = make_fabric("16-mixed", scaler=new_scaler())
    (sparse_model, sparse_opt), (dense_model, dense_opt) = (
        fabric.setup(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (sparse, dense)
    )
    twin_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in twins]
    scaler = new_scaler()
    for _ in range(3):
        for opt in (sparse_opt, dense_opt, *twin_opts):
            opt.zero_grad()
        fabric.backward(sparse_model(idx))
        fabric.strategy.precision.scaler.unscale_(sparse_opt)  # A, as in torch's recipe (before reading its grads)
        with fabric.autocast():
            loss = _loss(dense_model)
        fabric.backward(loss)
        sparse_opt.step()
        dense_opt.step()
        scaler.scale(twins[0](idx)).backward()
        scaler.unscale_(twin_opts[0])
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(twins[1])
        scaler.scale(loss).backward()
        for opt in twin_opts:
            scaler.step(opt)
        scaler.update()
    for model, twin in zip((sparse, dense), twins):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert fabric.strategy.precision.scaler.get_scale() == scaler.get_scale()


def test_a_backward_onto_clipped_gradients_that_did_not_step_is_refused():
    """``clip_gradients(A)``, then a ``backward`` that reaches A again before A steps, with no update owed: A's
    gradients would mix the true ones and new ones multiplied by the scale. torch's own loop steps on that mixture
    silently; Fabric refuses that backward, naming the fix, and a step on them never happens."""
    both = _Both(2)
    both.backward(0, 1)
    both.fabric.clip_gradients(both.models[0], both.opts[0], max_norm=1e9)
    before = [p.detach().clone() for p in both.models[0].parameters()]
    with pytest.raises(RuntimeError, match="Step SGD before the next backward that reaches its parameters"):
        both.backward(0)
    assert all(torch.equal(a, p) for a, p in zip(before, both.models[0].parameters()))
