"""FSDP2 (``fully_shard``): every param a DTensor sharded by rows, each rank's optimizer on
its own rows (``zenflow_triton.dist.fsdp``). On 2 gloo CPU ranks spawned by the test (the
harness of ``test_distributed``), against one process on the whole batch and against
``torch.optim.AdamW`` under FSDP2.

The model is a small transformer block whose row counts do not all divide by the ranks: 33
rows (17 + 16), and a gate with 1 row (rank 1 holds none of it)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zenflow_triton import NonFiniteGradientError, ZenFlowOptimizer
from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.state import by_rows
from zenflow_triton.state import state_side

from . import test_distributed as td
from .support.helpers import assert_trajectories_close

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")

VOCAB, D, SEQ, BATCH = 40, 33, 12, 8
STEPS = 20
LR = 1e-2
# min_offload_numel 32: every matrix is split, the 1-row gate (33 elements) too.
CFG = dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap=True,
           min_offload_numel=32, host_threads=1)
# Resume runs: windows of 4, saved at step 6 (mid-window, a host job's result pending).
RESUME_CFG = dict(CFG, update_interval=4, select_interval=8)


class Block(nn.Module):
    """Embedding, one attention head (q, k, v of 32 rows, out 33), an MLP (48 and 33
    rows), a norm, a head of VOCAB rows, and a 1-row gate on the residual."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        # No key bias: its gradient is zero up to rounding (softmax ignores a shift common
        # to a row's scores), and Adam would turn that rounding into whole steps.
        self.q, self.k, self.v = nn.Linear(D, 32), nn.Linear(D, 32, bias=False), nn.Linear(D, 32)
        self.o = nn.Linear(32, D)
        self.up, self.down = nn.Linear(D, 48), nn.Linear(48, D)
        self.norm = nn.LayerNorm(D)
        self.gate = nn.Linear(D, 1, bias=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        a = F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x), is_causal=True)
        x = x + self.o(a)
        x = x + torch.sigmoid(self.gate(x)) * self.down(torch.tanh(self.up(x)))
        return self.head(self.norm(x))


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    """Token sequences with structure to learn (each token predicts the next by a fixed
    map, with noise), BATCH a step: they split evenly over 2 ranks."""
    g = torch.Generator().manual_seed(1)
    nxt = torch.randperm(VOCAB, generator=g)
    out = []
    for _ in range(steps):
        t = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        t[:, 0] = torch.randint(VOCAB, (BATCH,), generator=g)
        for i in range(SEQ):
            noise = torch.rand(BATCH, generator=g) < 0.2
            t[:, i + 1] = torch.where(noise, torch.randint(VOCAB, (BATCH,), generator=g),
                                      nxt[t[:, i]])
        out.append(t)
    return out


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(model, opt, data, rank: int = 0, world: int = 1, poison=None) -> None:
    n = data[0].shape[0] // world
    for step, tokens in enumerate(data, 1):
        opt.zero_grad(set_to_none=True)
        loss_of(model, tokens[rank * n:(rank + 1) * n]).backward()
        if poison is not None:
            poison(step, model)
        opt.step()


def sharded_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = Block()
    fully_shard(model)
    return model


def _gathered(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _selections(opt, model) -> list[torch.Tensor]:
    return [opt.state[p]["device_idx"].clone() for p in model.parameters()
            if "device_idx" in opt.state[p]]


# ------------------------------------------------------------------------- scenarios
def train_scenario(rank: int) -> dict:
    model = sharded_model()
    world = dist.get_world_size()
    with ZenFlowOptimizer(model.parameters(), lr=LR, **CFG) as opt:
        train(model, opt, batches(), rank, world)
        opt.synchronize()
        st = opt.stats()
        local_rows = [opt.state[p]["host_master"].shape[0] for p in model.parameters()
                      if "host_master" in opt.state[p]]
        # the device state that has one entry per row (all but the column indices)
        row_state = sum(v.numel() * v.element_size() for p in model.parameters()
                        for k, v in opt.state[p].items()
                        if isinstance(v, torch.Tensor) and by_rows(k, v.dim())
                        and state_side(k, opt.config.accumulate_on) == "device")
        try:  # not under FSDP2: refused, naming what to use instead
            opt.to_adamw_state_dict()
            refused = None
        except NotImplementedError as e:
            refused = str(e)
        return dict(params=_gathered(model), device_idx=_selections(opt, model),
                    local_rows=local_rows, host_bytes=st["host_state_bytes"],
                    device_bytes=st["device_state_bytes"], device_row_bytes=row_state,
                    world=st["world_size"],
                    host_updates=st["host_updates"], refused=refused)


def _against_adamw(rank: int, **cfg) -> dict:
    """FSDP2 + ZenFlow with ``cfg`` and FSDP2 + torch.optim.AdamW from the same start:
    each rank's rows of both, after STEPS."""
    world = dist.get_world_size()
    out = {}
    for name in ("zenflow", "adamw"):
        model = sharded_model()
        if name == "zenflow":
            opt = ZenFlowOptimizer(model.parameters(), lr=LR, **{**CFG, **cfg})
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-2)
        train(model, opt, batches(), rank, world)
        if name == "zenflow":
            opt.synchronize()
            opt.close()
        out[name] = [p.to_local().detach().clone() for p in model.parameters()]
    return out


def topk_one_scenario(rank: int) -> dict:
    return _against_adamw(rank, topk_ratio=1.0)


def interval_one_scenario(rank: int) -> dict:
    # Reselecting every 3 steps: columns migrate between the halves during the run.
    return _against_adamw(rank, update_interval=1, select_interval=3, overlap=False)


CLIP = 0.05  # below every step's global norm here (~1): each step is clipped
CLIP_STEPS = 8


def clip_scenario(rank: int) -> dict:
    """``max_grad_norm`` under FSDP2, with the NaN/inf check (the ranks' squared norms ride
    its vote) and without (an all-reduce of their own): each step's norm as the optimizer
    reports it, and ``clip_grad_norm_``'s over the whole gradient (every rank's rows
    gathered), taken before the step."""
    world = dist.get_world_size()
    out = {}
    for check in (True, False):
        model = sharded_model()
        reported, full = [], []
        with ZenFlowOptimizer(model.parameters(), lr=LR, max_grad_norm=CLIP,
                              check_finite=check, **CFG) as opt:
            n = BATCH // world
            for tokens in batches(CLIP_STEPS):
                opt.zero_grad(set_to_none=True)
                loss_of(model, tokens[rank * n:(rank + 1) * n]).backward()
                whole = [p.grad.full_tensor() for p in model.parameters()]
                full.append(float(torch.nn.utils.get_total_norm(whole)))
                opt.step()
                reported.append(opt.stats()["grad_norm"])
            opt.synchronize()
            out[check] = dict(params=_gathered(model), reported=reported, full=full)
    return out


def host_fit_scenario(rank: int) -> dict:
    """The host memory check of an FSDP2 optimizer (device memory taken as ample), against
    a machine whose memory ``fraction`` of one process's host state (the whole model's)
    leaves available, with ``LOCAL_WORLD_SIZE`` as given (None: unset): each case's outcome
    on this rank, "fits" or the error."""
    from zenflow_triton import fit as F

    whole = F.host_bytes(list(Block().parameters()), ZenFlowConfig(**CFG))
    saved = (F.device_capacity_bytes, F.host_capacity_bytes, os.environ.get("LOCAL_WORLD_SIZE"))
    out = {}
    try:
        F.device_capacity_bytes = lambda device: 10 ** 15
        for fraction, ranks in ((0.75, "2"), (0.75, None), (0.75, "1"), (1.2, "2"),
                                (0.75, "two")):
            F.host_capacity_bytes = lambda: int(fraction * whole / (1 - F.HOST_HEADROOM))
            os.environ.pop("LOCAL_WORLD_SIZE", None)
            if ranks is not None:
                os.environ["LOCAL_WORLD_SIZE"] = ranks
            try:
                ZenFlowOptimizer(sharded_model().parameters(), lr=LR, **CFG).close()
                out[fraction, ranks] = "fits"
            except ValueError as e:
                out[fraction, ranks] = f"{type(e).__name__}: {e}"
    finally:
        F.device_capacity_bytes, F.host_capacity_bytes, env = saved
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if env is not None:
            os.environ["LOCAL_WORLD_SIZE"] = env
    return out


def nonfinite_scenario(rank: int, **cfg) -> dict:
    """Rank 1 alone finds a NaN in its rows of the MLP's gradient at step 5: both raise,
    and neither changed anything at that step."""
    model = sharded_model()
    world = dist.get_world_size()

    def poison(step, model):
        if step == 5 and rank == 1:
            model.up.weight.grad.to_local()[0, 0] = float("nan")

    opt = ZenFlowOptimizer(model.parameters(), lr=LR, **CFG, **cfg)
    data = batches(6)
    before = None
    try:
        def watch(step, model):
            nonlocal before
            if step == 5:
                opt.synchronize()  # the state before step 5, settled
                before = [p.to_local().detach().clone() for p in model.parameters()]
            poison(step, model)
        train(model, opt, data, rank, world, poison=watch)
        return dict(error=None)
    except NonFiniteGradientError as e:
        after = [p.to_local().detach().clone() for p in model.parameters()]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
        return dict(raised=str(e), unchanged=unchanged, steps=opt.stats()["steps"])
    finally:
        opt.close()


def _dcp_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _dcp_load(model, opt, path: str, **kwargs) -> None:
    """What a user writes to resume from a DCP checkpoint: the state dicts of a fresh model
    and optimizer as templates, loaded in place, then set."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)
    sd = _dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=path, **kwargs)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def dcp_scenario(rank: int) -> dict:
    """12 steps uninterrupted, saving model and optimizer through DCP at step 6
    (``get_optimizer_state_dict``: each rank writes its rows), and the full form there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)
    world = dist.get_world_size()
    path = os.path.join(td.OUT, "ckpt")
    data = batches(12)
    model = sharded_model()
    with ZenFlowOptimizer(model.parameters(), lr=LR, **RESUME_CFG) as opt:
        train(model, opt, data[:6], rank, world)
        dcp.save(_dcp_state(model, opt), checkpoint_id=path)
        opt.save_sharded(os.path.join(td.OUT, "sharded"))  # the optimizer's own door
        full = get_optimizer_state_dict(model, opt,
                                        options=StateDictOptions(full_state_dict=True))
        train(model, opt, data[6:], rank, world)
        opt.synchronize()
        return dict(want=_gathered(model), path=path, full=full)


def resume_scenario(rank: int) -> dict:
    """New processes: a fresh model and optimizer load the checkpoint of ``dcp_scenario``
    (in the directory above this run's) and train its last 6 steps; then another pair does
    the same with the optimizer through ``load_sharded`` (its template from the
    checkpoint's metadata, not from a fresh optimizer's state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         set_model_state_dict)
    top = os.path.dirname(td.OUT)
    out = {}
    for way in ("dcp", "sharded"):
        model = sharded_model()
        with ZenFlowOptimizer(model.parameters(), lr=LR, **RESUME_CFG) as opt:
            if way == "dcp":
                _dcp_load(model, opt, os.path.join(top, "ckpt"))
            else:
                sd = {"model": get_model_state_dict(model)}
                dcp.load(sd, checkpoint_id=os.path.join(top, "ckpt"))
                set_model_state_dict(model, sd["model"])
                opt.load_sharded(os.path.join(top, "sharded"))
            steps = opt.stats()["steps"]
            train(model, opt, batches(12)[6:], rank, dist.get_world_size())
            opt.synchronize()
            out[way] = dict(got=_gathered(model), steps=steps)
    return out


def failure_scenario(rank: int, **cfg) -> dict:
    """Rank 1's second host job raises: every rank raises at the next apply point."""
    td.inject_host_failure(rank)
    model = sharded_model()
    opt = ZenFlowOptimizer(model.parameters(), lr=LR, **dict(CFG, host_timeout=5.0, **cfg))
    res = td.until_failure(opt, lambda: train(model, opt, batches(), rank,
                                              dist.get_world_size()))
    return dict(failed=res["error"], seconds=res["seconds"])


def failure_in_warmup_scenario(rank: int) -> dict:
    """The failing job is a warm-up one, which writes the params itself (every column on
    the host, applied at once): the ranks whose job succeeded have nothing left to apply,
    and still vote."""
    return failure_scenario(rank, warmup_steps=4)


def hsdp_scenario(rank: int) -> dict:
    """HSDP (fully_shard on a 2-D mesh: replicated across one dim, sharded across the
    other) and a replicated DTensor: refused at construction, by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    out = {}
    model = Block()
    fully_shard(model, mesh=init_device_mesh("cpu", (1, dist.get_world_size()),
                                             mesh_dim_names=("replicate", "shard")))
    replicated = nn.Parameter(distribute_tensor(torch.ones(8, 8),
                                                init_device_mesh("cpu", (2,)), [Replicate()]))
    for what, params in (("hsdp", list(model.named_parameters())[:3]),
                         ("replicated", [("w", replicated)])):
        try:
            ZenFlowOptimizer(params, lr=LR, **CFG)
            out[what] = None
        except TypeError as e:
            out[what] = str(e)
    fsdp = list(sharded_model().parameters())
    plain = nn.Parameter(torch.zeros(8, 8))
    for what, make in (
            ("mixed", lambda: ZenFlowOptimizer(fsdp + [plain], lr=LR, **CFG)),
            ("group", lambda: ZenFlowOptimizer(fsdp, lr=LR, process_group=dist.new_group(),
                                               **CFG))):
        try:
            make().close()
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    with ZenFlowOptimizer(fsdp, lr=LR, **CFG) as opt:
        try:
            opt.add_param_group({"params": [plain]})
            out["added"] = None
        except ValueError as e:
            out["added"] = str(e)
        out["groups"] = len(opt.param_groups)
    return out


def _one_process(cfg: dict, world: int = 1
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """One process on the rows the ``world`` ranks see together (all of a batch that
    divides; 6 of 8 for 3 ranks)."""
    model = Block()
    used = BATCH // world * world
    with ZenFlowOptimizer(model.parameters(), lr=LR, **cfg) as opt:
        train(model, opt, [t[:used] for t in batches()])
        opt.synchronize()
        return ([p.detach().clone() for p in model.parameters()], _selections(opt, model),
                opt.stats()["host_state_bytes"])


# ------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.skipif(
    os.environ.get("ZENFLOW_SLOW") != "1", reason="3 ranks: set ZENFLOW_SLOW=1"))])
def test_fsdp2_ranks_follow_one_process_on_the_whole_batch(tmp_path, world):
    """20 steps under FSDP2: every rank makes one process's selections (the column scores
    summed over the ranks' rows), and the gathered params follow one process on the whole
    batch to fp32 rounding. Each rank keeps only its rows: 17 and 16 of the 33-row
    matrices on 2 ranks (11 each on 3), and the gate's one row on rank 0 only."""
    res = td.spawn("tests.test_fsdp2:train_scenario", tmp_path, world=world)
    a = res[0]
    assert "get_optimizer_state_dict" in a["refused"]
    want, single_idx, single_host = _one_process(CFG, world)
    for r in res[1:]:
        for x, y in zip(a["device_idx"], r["device_idx"]):
            assert torch.equal(x, y)
        for x, y in zip(a["params"], r["params"]):
            assert torch.equal(x, y)
    assert len(a["device_idx"]) == len(single_idx)
    for x, y in zip(a["device_idx"], single_idx):
        assert torch.equal(x, y)
    assert_trajectories_close(a["params"], want, STEPS, LR * CFG["update_interval"])
    whole = [p.shape[0] for p in Block().parameters() if p.dim() == 2]
    assert [sum(rows) for rows in zip(*(r["local_rows"] for r in res))] == whole
    assert 1 in a["local_rows"] and all(0 in r["local_rows"] for r in res[1:])  # the gate
    # Host memory per rank about 1/world (the rows split 17/16, 20/20, ... on 2 ranks).
    host = [r["host_bytes"] for r in res]
    assert sum(host) <= 1.05 * single_host
    assert max(host) < (1 / world + 0.1) * single_host
    # `zenflow-tune predict --sharding fsdp2` counts what the ranks hold on the device: its
    # per-GPU figure of the per-row state (moments of the device-owned columns and of the
    # small params, the accumulator) is the ranks' mean, exactly. (Unnamed params: no
    # dense set. The column indices, whole on each rank, are left out: on a CPU rank their
    # "device" copies are numpy views whose storage is not what a GPU would hold. The host
    # side is DDP's formula, checked against stats() in test_stepmodel.)
    from autotune import stepmodel as S

    from .test_stepmodel import hw

    pred = S.predict(hw(), S.Workload.from_module(Block()), "zenflow", gpus=world,
                     sharding="fsdp2", dense_params=(), **CFG)
    rows = S.optimizer_state_bytes(pred.memory["device"]) - pred.memory["device"].get(
        "column indices", 0)
    assert sum(r["device_row_bytes"] for r in res) == pytest.approx(world * rows, rel=1e-9)
    numel = sum(p.numel() for p in Block().parameters())
    assert pred.memory["device"]["params"] == pytest.approx(numel * 4 / world)


@pytest.mark.parametrize("scenario", ["topk_one_scenario", "interval_one_scenario"])
def test_fsdp2_equals_adamw_where_zenflow_is_adamw(tmp_path, scenario):
    """topk_ratio=1.0 (every column on the device) and update_interval=1 without overlap
    (every host column updated at its own step): FSDP2 + ZenFlow is FSDP2 +
    torch.optim.AdamW, each rank's rows to fp32 rounding."""
    for res in td.spawn(f"tests.test_fsdp2:{scenario}", tmp_path):
        assert_trajectories_close(res["zenflow"], res["adamw"], STEPS, LR)


def test_fsdp2_clips_every_rank_by_the_global_norm(tmp_path):
    """``max_grad_norm`` under FSDP2: every rank clips by one coefficient, that of the
    whole gradient's norm (each rank's rows' squared norms summed over the ranks), as
    ``clip_grad_norm_`` over the gathered gradient gives it to fp32 rounding; the params
    follow one process that clips with ``clip_grad_norm_`` on the whole batch."""
    a, b = td.spawn("tests.test_fsdp2:clip_scenario", tmp_path)
    # The bound. Each side takes a gradient's norm as fp32 sums of squares: n terms (n the
    # largest numel, any summation order) are within n*u of the exact sum (u = 2**-24), so
    # the norm within (n/2 + 2)u with its root and rounding; the optimizer's adds its two
    # ranks' parts in fp64 and rounds once more: the two per-gradient norms are within
    # (n + 5)u. The norm of the 16 norms adds (8 + 2)u on each side, the coefficient's
    # add and divide 2u each: |c - c_ref| <= (n + 29)u * c_ref.
    n = max(p.numel() for p in Block().parameters())
    rtol = (n + 29) * 2.0 ** -24
    for check in (True, False):  # the norms riding the NaN/inf vote; their own all-reduce
        assert a[check]["reported"] == b[check]["reported"]  # one coefficient on every rank
        for got, full in zip(a[check]["reported"], a[check]["full"]):
            coef, want = min(1.0, CLIP / (got + 1e-6)), min(1.0, CLIP / (full + 1e-6))
            assert want < 1.0 and abs(coef - want) <= rtol * want, (check, got, full)
    for x, y in zip(a[True]["params"], a[False]["params"]):
        assert torch.equal(x, y)  # the same sums, whichever collective carried them
    model = Block()
    with ZenFlowOptimizer(model.parameters(), lr=LR, **CFG) as opt:
        for tokens in batches(CLIP_STEPS):
            opt.zero_grad(set_to_none=True)
            loss_of(model, tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        opt.synchronize()
        want = [p.detach().clone() for p in model.parameters()]
    assert_trajectories_close(a[True]["params"], want, CLIP_STEPS, LR * CFG["update_interval"])


def test_fsdp2_host_check_counts_every_rank_on_the_machine(tmp_path):
    """Under FSDP2 each rank holds its rows of the host state, about half the model's on 2
    ranks, but both take them from one machine's memory: with 3/4 of the model's host
    state available the check refuses (LOCAL_WORLD_SIZE=2, or unset: every rank of the
    mesh counts), on every rank alike; one rank per machine fits, and so do 2 ranks with
    1.2 times the model's. A LOCAL_WORLD_SIZE that is no count is refused by name."""
    for res in td.spawn("tests.test_fsdp2:host_fit_scenario", tmp_path):
        for ranks in ("2", None):
            assert res[0.75, ranks].startswith("DoesNotFitError"), res
            assert "of host memory" in res[0.75, ranks] and "2 ranks" in res[0.75, ranks]
        assert "LOCAL_WORLD_SIZE" in res[0.75, None]  # it says how to count otherwise
        assert res[0.75, "1"] == "fits" and res[1.2, "2"] == "fits", res
        assert res[0.75, "two"].startswith("ValueError") and "LOCAL_WORLD_SIZE='two'" in \
            res[0.75, "two"], res


def nonfinite_clipped_scenario(rank: int) -> dict:
    """:func:`nonfinite_scenario` clipping: the squared norms ride the vote on the flags."""
    return nonfinite_scenario(rank, max_grad_norm=CLIP)


@pytest.mark.parametrize("scenario", ["nonfinite_scenario", "nonfinite_clipped_scenario"])
def test_fsdp2_nonfinite_gradient_on_one_rank_raises_on_every_rank(tmp_path, scenario):
    a, b = td.spawn(f"tests.test_fsdp2:{scenario}", tmp_path)
    for res in (a, b):
        assert res.get("raised") and "non-finite gradient" in res["raised"], res
        assert "shape (48, 33)" in res["raised"], res  # the MLP's up projection, whole
        assert res["unchanged"] and res["steps"] == 4


def test_fsdp2_dcp_checkpoint_resumes_bit_for_bit_and_loads_into_one_process(tmp_path):
    """Saved through ``torch.distributed.checkpoint`` at step 6 (mid-window, a host result
    pending) on 2 ranks, loaded by a fresh model and optimizer in new processes: the next 6
    steps equal the uninterrupted run bit for bit, through DCP's state dict API and through
    the optimizer's save_sharded/load_sharded alike. The full form
    (``full_state_dict=True``) holds every row. One process loads the same checkpoints (DCP
    reshards 2 ranks to 1) and follows the 2-rank run on the whole batch to fp32 rounding,
    the same through both doors."""
    a, b = td.spawn("tests.test_fsdp2:dcp_scenario", tmp_path)
    (tmp_path / "resume").mkdir()
    for both, want in zip(td.spawn("tests.test_fsdp2:resume_scenario", tmp_path / "resume"),
                          (a, b)):
        for way in ("dcp", "sharded"):  # DCP's state dict API; save_sharded/load_sharded
            assert both[way]["steps"] == 6, way
            for x, y in zip(both[way]["got"], want["want"]):
                assert torch.equal(x, y), way
    model = Block()
    full = a["full"]["state"]
    for name, p in model.named_parameters():
        for key, value in full[name].items():
            if isinstance(value, torch.Tensor) and value.dim() and not key.endswith("_idx"):
                assert value.shape[0] == p.shape[0], (name, key)
    with ZenFlowOptimizer(model.parameters(), lr=LR, **RESUME_CFG) as opt:
        _dcp_load(model, opt, a["path"], no_dist=True)
        assert opt.stats()["steps"] == 6
        at_6 = [p.detach().clone() for p in model.parameters()]
        train(model, opt, batches(12)[6:])
        opt.synchronize()
        got = [p.detach().clone() for p in model.parameters()]
    assert_trajectories_close(got, a["want"], 12, LR * RESUME_CFG["update_interval"])
    # save_sharded() under FSDP2 (resumed bit for bit above) loads into one process too.
    model = Block()
    for p, w in zip(model.parameters(), at_6):
        p.data.copy_(w)
    with ZenFlowOptimizer(model.parameters(), lr=LR, **RESUME_CFG) as opt:
        opt.load_sharded(tmp_path / "sharded")
        for p, st in zip(model.parameters(), opt.state.values()):
            assert all(v.shape[0] == p.shape[0] for k, v in st.items()
                       if isinstance(v, torch.Tensor) and v.dim() and not k.endswith("_idx"))
        train(model, opt, batches(12)[6:])
        opt.synchronize()
        again = [p.detach().clone() for p in model.parameters()]
    for x, y in zip(again, got):
        assert torch.equal(x, y)  # the same state as through DCP's state_dict API


def test_hsdp_and_other_dtensors_are_refused_by_name(tmp_path):
    """Refused with what to do instead: HSDP (a 2-D mesh), a replicated DTensor, plain
    params beside DTensors (a plain one's rows would count once per rank), a process group
    other than the mesh's, and a plain param group added to an FSDP2 optimizer (which
    leaves its groups as they were)."""
    for res in td.spawn("tests.test_fsdp2:hsdp_scenario", tmp_path):
        assert res["hsdp"] and "'embed.weight'" in res["hsdp"] and "2-D mesh" in res["hsdp"]
        assert res["replicated"] and "'w'" in res["replicated"] \
            and "Replicate" in res["replicated"]
        assert res["mixed"] and "plain tensors beside FSDP2" in res["mixed"]
        assert res["group"] and "mesh's group" in res["group"]
        assert res["added"] and "FSDP2 DTensors" in res["added"] and res["groups"] == 1


@pytest.mark.parametrize("scenario", ["failure_scenario", "failure_in_warmup_scenario"])
def test_a_failing_rank_fails_every_rank_under_fsdp2(tmp_path, scenario):
    """Rank 1's host job raises (a windowed one, or a warm-up one that writes the params
    itself): rank 1 raises its own error, rank 0 a ShardError naming rank 1, at the same
    apply point, well within ``host_timeout``; no hang."""
    a, b = td.spawn(f"tests.test_fsdp2:{scenario}", tmp_path)
    assert b["failed"] and "injected host failure on rank 1" in b["failed"], b
    assert a["failed"] and "ShardError" in a["failed"] and "rank(s) [1]" in a["failed"], a
    assert a["seconds"] < 60 and b["seconds"] < 60, (a, b)


def test_the_fsdp2_example_runs_under_torchrun(tmp_path):
    """examples/train_fsdp2.py on 2 gloo ranks (torchrun --standalone): it trains with
    global-norm clipping, saves through DCP, prints every rank's optimizer memory, and
    checks that every rank made the same selections (exit status 1 if not)."""
    out = td.torchrun(["examples/train_fsdp2.py", "--steps", "12", "--save",
                       str(tmp_path / "ck")])
    assert "world 2: the same selections on every rank: True" in out, out[-3000:]
    assert "rank 1: host state" in out and (tmp_path / "ck" / ".metadata").exists()


def test_cpu_offloaded_fsdp2_params_are_refused_with_the_reason():
    """FSDP2's CPUOffloadPolicy keeps the params of a CUDA mesh in host memory; ZenFlow's
    host half already is that offload, so it is refused, saying so. (No CUDA here: the
    check reads the mesh's device type and the local tensor's device, given directly.)"""
    from types import SimpleNamespace

    from torch.distributed.tensor import Shard

    from zenflow_triton.dist.fsdp import check_param

    class DTensor(SimpleNamespace):  # what check_param reads of one
        pass

    def param(device_type):
        return DTensor(device_mesh=SimpleNamespace(ndim=1, device_type=device_type),
                       placements=(Shard(0),), _local_tensor=torch.zeros(4, 4))

    with pytest.raises(TypeError, match="CPUOffloadPolicy.*does that part itself"):
        check_param(param("cuda"), "'w'")
    check_param(param("cpu"), "'w'")  # gloo on CPU: nothing is offloaded
