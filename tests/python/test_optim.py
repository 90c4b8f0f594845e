"""netdam.optim against torch.optim: three ranks (threads, each with its own
Group and model replica, on three netdamd devices) train a small MLP on
different data for 100 steps with an offloaded optimizer; a single torch
model trained by torch.optim on the ranks' averaged gradients must end
with the same weights to float32 tolerance.

The only difference allowed is rounding: the devices sum the ranks'
gradients in ring order, the reference in rank order."""

import unittest
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import netdam
import netdam.optim
from cluster import ClusterTestCase

P = 3
STEPS = 100


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    return x, y


def grads_of(model, rank, step):
    model.zero_grad(set_to_none=True)
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


class OptimTest(ClusterTestCase):
    RANKS = P
    MEMORY = "32MiB"
    GROUP_TIMEOUT = 10.0

    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(1)
        super().setUpClass()

    def train(self, make_offloaded, make_reference, steps=STEPS):
        replicas = [make_model(1) for _ in range(P)]
        optims = [None] * P

        def init(r):
            optims[r] = make_offloaded(replicas[r].parameters(), self.groups[r])

        with ThreadPoolExecutor(P) as ex:
            list(ex.map(init, range(P)))
        reference = make_model(1)
        ref_opt = make_reference(reference.parameters())

        def rank_step(r, step):
            replicas[r].zero_grad(set_to_none=True)
            x, y = batch(r, step)
            torch.nn.functional.mse_loss(replicas[r](x), y).backward()
            optims[r].step()

        with ThreadPoolExecutor(P) as ex:
            for step in range(steps):
                # The reference: the average of the ranks' gradients (as DDP
                # computes it), then torch.optim.
                per_rank = [grads_of(reference, r, step) for r in range(P)]
                for p, *gs in zip(reference.parameters(), *per_rank):
                    p.grad = sum(gs) / P
                ref_opt.step()
                list(ex.map(rank_step, range(P), [step] * P))
        return replicas, optims, reference, ref_opt

    def assert_close(self, replicas, reference):
        want = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        for r, m in enumerate(replicas):
            got = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"rank {r}")
        # Every replica holds the very same weights (the devices sent them).
        for m in replicas[1:]:
            for a, b in zip(m.parameters(), replicas[0].parameters()):
                self.assertTrue(torch.equal(a, b))

    def test_sgd_momentum_nesterov_weight_decay(self):
        replicas, optims, reference, ref_opt = self.train(
            lambda ps, g: netdam.optim.OffloadedSGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                    weight_decay=1e-3, group=g),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3))
        self.assert_close(replicas, reference)
        # The momentum buffer the devices hold is torch's.
        buf = optims[0].device_state()["momentum_buffer"]
        want = torch.cat([ref_opt.state[p]["momentum_buffer"].reshape(-1) for p in reference.parameters()])
        torch.testing.assert_close(buf, want, rtol=1e-4, atol=1e-5)

    def test_adam(self):
        replicas, optims, reference, ref_opt = self.train(
            lambda ps, g: netdam.optim.OffloadedAdam(ps, lr=1e-2, weight_decay=1e-2, group=g),
            lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2))
        self.assert_close(replicas, reference)
        state = optims[1].device_state()
        self.assertEqual(state["step"], STEPS)
        for name in ("exp_avg", "exp_avg_sq"):
            want = torch.cat([ref_opt.state[p][name].reshape(-1) for p in reference.parameters()])
            torch.testing.assert_close(state[name], want, rtol=1e-3, atol=1e-6, msg=name)

    def test_adamw_with_a_learning_rate_schedule(self):
        def offloaded(ps, g):
            opt = netdam.optim.OffloadedAdam(ps, lr=1e-2, weight_decay=0.1, decoupled=True, group=g)
            offloaded.scheds.append(torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5))
            return opt
        offloaded.scheds = []

        def reference(ps):
            opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
            reference.sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
            return opt
        replicas, optims, reference_model, ref_opt = self.train(offloaded, reference, steps=1)
        # The schedule: step the schedulers between steps, on both sides.
        ref_sched = reference.sched
        for s in offloaded.scheds:
            s.step()
        ref_sched.step()
        with ThreadPoolExecutor(P) as ex:
            for step in range(1, 40):
                per_rank = [grads_of(reference_model, r, step) for r in range(P)]
                for p, *gs in zip(reference_model.parameters(), *per_rank):
                    p.grad = sum(gs) / P
                ref_opt.step()
                ref_sched.step()

                def rank_step(r):
                    replicas[r].zero_grad(set_to_none=True)
                    x, y = batch(r, step)
                    torch.nn.functional.mse_loss(replicas[r](x), y).backward()
                    optims[r].step()
                    offloaded.scheds[r].step()
                list(ex.map(rank_step, range(P)))
        self.assertAlmostEqual(optims[0].param_groups[0]["lr"], ref_opt.param_groups[0]["lr"])
        self.assertAlmostEqual(optims[0].param_groups[0]["lr"], 1e-2 * 0.5 ** 4)
        self.assert_close(replicas, reference_model)

    def test_already_averaged_gradients(self):
        # reduce=False: every rank passes the same (averaged) gradients.
        model = [make_model(2) for _ in range(P)]
        opts = [None] * P
        with ThreadPoolExecutor(P) as ex:
            list(ex.map(lambda r: opts.__setitem__(r, netdam.optim.OffloadedSGD(
                model[r].parameters(), lr=0.1, group=self.groups[r], reduce=False)), range(P)))
            reference = make_model(2)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            for step in range(5):
                grads = grads_of(reference, 0, step)
                ref_opt.step()
                for r in range(P):
                    for p, g in zip(model[r].parameters(), grads):
                        p.grad = g.clone()
                list(ex.map(lambda r: opts[r].step(), range(P)))
        # One rank's gradients plus zeros are those gradients exactly; what
        # remains is the rounding of the update itself (torch fuses some of
        # its multiply-adds, the devices do not).
        for m in model:
            for a, b in zip(m.parameters(), reference.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    def test_refusals(self):
        with self.assertRaises(TypeError):
            netdam.optim.OffloadedSGD([torch.zeros(3, dtype=torch.float64)], lr=0.1, group=self.groups[0])
        with self.assertRaises(ValueError):
            netdam.optim.OffloadedAdam(make_model(0).parameters(), amsgrad=True, group=self.groups[0])
        with self.assertRaises(ValueError):
            netdam.optim.OffloadedSGD(make_model(0).parameters(), lr=0.1, nesterov=True, group=self.groups[0])
        with self.assertRaises(netdam.InvalidArgument):
            self.groups[0].optimizer_step(np.zeros(3, np.float32), np.zeros(3, np.float32), kind="sgd",
                                          step=1, lr=0.1)  # no offload_init on this group yet... or wrong size
        with self.assertRaises(ValueError):
            self.groups[0].optimizer_step(np.zeros(3, np.float32), np.zeros(3, np.float32), kind="lamb",
                                          step=1, lr=0.1)


if __name__ == "__main__":
    unittest.main()
