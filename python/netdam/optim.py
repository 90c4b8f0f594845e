"""Optimizers whose weights and state live on the netdam devices.

:class:`OffloadedSGD` and :class:`OffloadedAdam` are drop-in replacements
for ``torch.optim.SGD`` and ``torch.optim.Adam``/``AdamW`` in a data-parallel
job: every rank calls ``step()`` after its backward pass, and the devices
do the rest (docs/COLLECTIVES.md, section 10):

1. each rank's gradients go into the network; the chain that reduces a
   block of them ends at the device that holds those weights,
2. that device applies the optimizer to its weights and its state
   (momentum buffer, or Adam's two moments), exactly once even when packets
   are lost or duplicated,
3. the updated weights come back to every rank and are copied into the
   model's parameters.

No rank keeps optimizer state, and the gradients need no separate
all-reduce: with ``DistributedDataParallel`` register
:func:`local_gradients_hook` so DDP leaves the gradients local, and the
optimizer averages them in the network. Without the hook (or when the
gradients are already averaged by other means) pass ``reduce=False``.

The arithmetic follows torch 1.13's single-tensor implementations in
float32; the gradients of the ranks are summed in the ring order of the
devices, so results match torch.optim on the same averaged gradients to
float32 rounding (tests/python/test_optim.py checks 100 steps).

Importing this module imports torch.
"""

from __future__ import annotations

import torch

from ._netdam import Group

__all__ = ["OffloadedSGD", "OffloadedAdam", "local_gradients_hook", "offload_group"]


def local_gradients_hook(state, bucket):
    """A DDP communication hook that leaves each rank's gradients as they are.

    Use it with an offloaded optimizer, which reduces the gradients itself:
    ``ddp.register_comm_hook(None, netdam.optim.local_gradients_hook)``.
    """
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def offload_group(count_hint: int = 0, **group_kwargs) -> Group:
    """A :class:`netdam.Group` for an offloaded optimizer of this process.

    Under ``torch.distributed`` with the ``netdam`` backend, the group uses
    the backend's devices (netdam.distributed.optimizer_group); otherwise
    pass ``rank``, ``devices`` and ``admin_key`` as to :class:`netdam.Group`.
    """
    if "devices" in group_kwargs:
        return Group(**group_kwargs)
    from . import distributed  # registers the backend; imports torch.distributed
    return distributed.optimizer_group(**group_kwargs)


class _Offloaded(torch.optim.Optimizer):
    """The common part: one flat float32 vector of every parameter."""

    _kind = ""

    def __init__(self, params, defaults: dict, group: Group | None, reduce: bool):
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError(f"{type(self).__name__} supports one parameter group "
                             f"(got {len(self.param_groups)}): the devices apply one config")
        self._params = list(self.param_groups[0]["params"])
        for i, p in enumerate(self._params):
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise TypeError(f"parameter {i}: offloaded optimizers take float32 CPU tensors, "
                                f"got {p.dtype} on {p.device}")
        self._count = sum(p.numel() for p in self._params)
        if self._count == 0:
            raise ValueError("no parameters to optimize")
        self._group = group if group is not None else offload_group()
        self._reduce = reduce
        self._weights = torch.cat([p.detach().reshape(-1) for p in self._params]).contiguous()
        self._grad = torch.zeros(self._count, dtype=torch.float32)
        self._group.offload_init(self._weights.numpy())
        self._step = 0

    @property
    def group(self) -> Group:
        """The netdam.Group whose devices hold the weights."""
        return self._group

    def _config(self) -> dict:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        """Sends this rank's gradients; the devices update the weights.

        Every rank must call it, with the same hyper-parameters (e.g. the
        same learning-rate schedule). Parameters without a gradient count
        as zero gradients (torch.optim would skip them).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        offset = 0
        for p in self._params:
            n = p.numel()
            if p.grad is None:
                self._grad[offset:offset + n].zero_()
            else:
                if p.grad.is_sparse:
                    raise TypeError("offloaded optimizers do not take sparse gradients")
                self._grad[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        size = self._group.size
        if self._reduce:
            scale = 1.0 / size  # the average over the ranks, as DDP takes it
        else:
            # The gradients are the same everywhere already: one rank's copy
            # plus zeros is that copy exactly.
            scale = 1.0
            if self._group.rank != 0:
                self._grad.zero_()
        self._step += 1
        self._group.optimizer_step(self._grad.numpy(), self._weights.numpy(),
                                   step=self._step, grad_scale=scale, **self._config())
        offset = 0
        for p in self._params:
            n = p.numel()
            p.copy_(self._weights[offset:offset + n].view_as(p))
            offset += n
        return loss

    def device_state(self) -> dict:
        """The state the devices hold, as flat float32 tensors (for checks
        and checkpoints): ``weights`` and the optimizer's state vectors."""
        out = {"step": self._step, "weights": torch.empty(self._count)}
        self._group.offload_read(out["weights"].numpy(), 0)
        for name, which in self._state_names():
            out[name] = torch.empty(self._count)
            self._group.offload_read(out[name].numpy(), which)
        return out

    def _state_names(self):
        return []

    def load_state_dict(self, state_dict):
        raise NotImplementedError(
            f"{type(self).__name__} keeps its state on the devices; restoring it from a "
            "state_dict is not supported (device_state() reads it out)")


class OffloadedSGD(_Offloaded):
    """torch.optim.SGD (momentum, dampening, Nesterov, weight decay) on the devices.

    Args: params (an iterable of float32 CPU tensors, one group), lr,
    momentum, dampening, weight_decay, nesterov as for torch.optim.SGD;
    group: the netdam.Group to use (default: :func:`offload_group`);
    reduce: average the ranks' gradients in the network (default) or take
    gradients that are already averaged.
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 group: Group | None = None, reduce: bool = True):
        if lr < 0.0 or momentum < 0.0 or weight_decay < 0.0:
            raise ValueError(f"invalid lr {lr}, momentum {momentum} or weight_decay {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if maximize:
            raise ValueError("maximize is not supported by the devices")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, group, reduce)

    def _config(self) -> dict:
        g = self.param_groups[0]
        return dict(kind="sgd", lr=g["lr"], momentum=g["momentum"], dampening=g["dampening"],
                    weight_decay=g["weight_decay"], nesterov=g["nesterov"])

    def _state_names(self):
        return [("momentum_buffer", 1)] if self.param_groups[0]["momentum"] != 0 else []


class OffloadedAdam(_Offloaded):
    """torch.optim.Adam, or AdamW with ``decoupled=True``, on the devices.

    Args: params, lr, betas, eps, weight_decay as for torch.optim.Adam;
    decoupled: AdamW's weight decay (p *= 1 - lr*wd); group and reduce as
    for :class:`OffloadedSGD`. amsgrad is not supported.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, decoupled: bool = False,
                 maximize: bool = False, group: Group | None = None, reduce: bool = True):
        if lr < 0.0 or eps < 0.0 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid lr {lr}, eps {eps} or betas {betas}")
        if amsgrad or maximize:
            raise ValueError("amsgrad and maximize are not supported by the devices")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled=decoupled)
        super().__init__(params, defaults, group, reduce)

    def _config(self) -> dict:
        g = self.param_groups[0]
        return dict(kind="adamw" if g["decoupled"] else "adam", lr=g["lr"], beta1=g["betas"][0],
                    beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"])

    def _state_names(self):
        return [("exp_avg", 1), ("exp_avg_sq", 2)]
