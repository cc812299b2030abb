"""Custom autograd Functions (and modules calling them) used by the PythonOp tests."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist


class Cube(torch.autograd.Function):
    """x**3 with its exact derivative, saving its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * x**2


class MulAdd(torch.autograd.Function):
    """(a * b, a + b): two tensor inputs, two tensor outputs."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b, a + b

    @staticmethod
    def backward(ctx, g_prod, g_sum):
        a, b = ctx.saved_tensors
        return g_prod * b + g_sum, g_prod * a + g_sum


class Constants(torch.autograd.Function):
    """Uses one argument of every constant kind; asserts each arrives with its Python type."""

    @staticmethod
    def forward(ctx, x, k, scale, flag, shape, weights, mask, nothing, mode):
        assert type(k) is int and type(scale) is float and type(flag) is bool, (k, scale, flag)
        assert type(shape) is tuple and all(type(v) is int for v in shape), shape
        assert all(type(v) is float for v in weights) and all(type(v) is bool for v in mask)
        assert nothing is None and type(mode) is str, (nothing, mode)
        ctx.factor = k * scale * (2.0 if flag else 1.0) * sum(weights) * (1 + sum(mask))
        ctx.factor *= 3.0 if mode == "triple" else 1.0
        ctx.in_shape = x.shape
        return (x * ctx.factor).reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return (g * ctx.factor).reshape(ctx.in_shape), *[None] * 8


class MaskedScale(torch.autograd.Function):
    """x * mask: the mask needs no gradient; backward checks ctx.needs_input_grad."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        assert ctx.needs_input_grad == (True, False), ctx.needs_input_grad
        (mask,) = ctx.saved_tensors
        return g * mask, None


class SortedWithIndex(torch.autograd.Function):
    """(values, positions): the positions are marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        values, idx = torch.sort(x, dim=-1)
        positions = idx.to(x.dtype)
        ctx.mark_non_differentiable(positions)
        ctx.save_for_backward(idx)
        return values, positions

    @staticmethod
    def backward(ctx, g, g_positions):
        (idx,) = ctx.saved_tensors
        return torch.zeros_like(g).scatter_(-1, idx, g)


class SplitNoMaterialize(torch.autograd.Function):
    """(2x, 3x) with set_materialize_grads(False): a missing gradient arrives as None."""

    seen: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return 2 * x, 3 * x

    @staticmethod
    def backward(ctx, g_a, g_b):
        SplitNoMaterialize.seen.append((g_a is None, g_b is None))
        out = None
        if g_a is not None:
            out = 2 * g_a
        if g_b is not None:
            out = 3 * g_b if out is None else out + 3 * g_b
        return out


class Passthrough(torch.autograd.Function):
    """Returns its input unchanged; the backward doubles the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class TransposeView(torch.autograd.Function):
    """Returns a (non-contiguous) view of its input."""

    @staticmethod
    def forward(ctx, x):
        return x.t()

    @staticmethod
    def backward(ctx, g):
        return g.t()


class DoubleInPlace(torch.autograd.Function):
    """Doubles its input in place and says so with mark_dirty."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class RoundSTE(torch.autograd.Function):
    """Straight-through rounding: forward rounds (true derivative 0), backward passes |x| <= 1."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1).to(g.dtype)


class GradMode(torch.autograd.Function):
    """Records whether autograd was on when forward ran (eval/inference must not keep a ctx)."""

    seen: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x):
        GradMode.seen.append(torch.is_grad_enabled())
        return x + 1

    @staticmethod
    def backward(ctx, g):
        return g


class FailingForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        raise ValueError("forward refuses negative inputs")

    @staticmethod
    def backward(ctx, g):
        return g


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("backward cannot do that")


class Threshold(torch.autograd.Function):
    """(x, x > 0): a bool output crossing the boundary."""

    @staticmethod
    def forward(ctx, x):
        mask = x > 0
        ctx.mark_non_differentiable(mask)
        return x.clone(), mask

    @staticmethod
    def backward(ctx, g, g_mask):
        return g


class Net(torch.nn.Module):
    """Linear -> tanh -> RoundSTE -> Linear: trains only through the custom backward."""

    def __init__(self, n_in: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.a = torch.nn.Linear(n_in, hidden)
        self.b = torch.nn.Linear(hidden, 1)

    def forward(self, x):
        return self.b(RoundSTE.apply(2 * torch.tanh(self.a(x))))


class Apply(torch.nn.Module):
    """A Linear layer (so there are parameters) followed by ``fn(h, *rest)``."""

    def __init__(self, fn, n: int = 4, out: int = 4, post=None) -> None:
        super().__init__()
        self.fn, self.post = fn, post
        self.lin = torch.nn.Linear(n, out)

    def forward(self, x, *rest):
        y = self.fn(self.lin(x), *rest)
        return self.post(y) if self.post is not None else y


class Tagged(torch.autograd.Function):
    """Takes any second argument and ignores it."""

    @staticmethod
    def forward(ctx, x, tag):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


# ---- collectives (Megatron-style tensor parallelism; ORTModule's Reduce*MarkDirty) ----------------
class AllReduceSum(torch.autograd.Function):
    """Megatron's 'reduce from the model-parallel region': all-reduce in forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g


class CopyToParallel(torch.autograd.Function):
    """Megatron's 'copy to the model-parallel region': identity forward, all-reduce in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class ReduceMarkDirty(torch.autograd.Function):
    """All-reduces its input in place and says so (ORTModule's ReduceWithMarkDirty)."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class ReduceNoMarkDirty(torch.autograd.Function):
    """All-reduces its input in place without mark_dirty (ORTModule's ReduceWithoutMarkDirty)."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class TensorParallel(torch.nn.Module):
    """Linear -> CopyToParallel -> tanh -> Linear -> AllReduceSum -> + bias."""

    def __init__(self, n: int = 6, hidden: int = 8) -> None:
        super().__init__()
        self.a = torch.nn.Linear(n, hidden)
        self.b = torch.nn.Linear(hidden, n, bias=False)
        self.bias = torch.nn.Parameter(torch.linspace(-0.5, 0.5, n))
        self.copy, self.reduce = CopyToParallel.apply, AllReduceSum.apply  # bound before export

    def forward(self, x):
        return self.reduce(self.b(torch.tanh(self.copy(self.a(x))))) + self.bias


class ReduceModel(torch.nn.Module):
    """ORTModule's Reduce*MarkDirtyModel: x = input + bias; x is reduced, then read again."""

    def __init__(self, fn, n: int = 5) -> None:
        super().__init__()
        self.fn = fn
        self.bias = torch.nn.Parameter(torch.linspace(0.1, 0.5, n))

    def forward(self, inp):
        x = inp + self.bias
        y1 = self.fn(x)
        y2 = x.add(self.bias)
        return x + y1 + y2


class ScaleBy(torch.autograd.Function):
    """(x * s, x * t[0] * t[1]) for a float ``s`` and a float tuple ``t``: Python floats, used in
    float64 (whether the exact value reaches the Function shows in the outputs)."""

    @staticmethod
    def forward(ctx, x, s, t):
        ctx.s, ctx.t = s, t
        return x * s, x * t[0] * t[1]

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 * ctx.s + g2 * ctx.t[0] * ctx.t[1], None, None
