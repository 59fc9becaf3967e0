"""accelerate: what ``accelerator.prepare`` returns goes into ``TrainingState`` and the loop resumes bitwise.

A typical accelerate loop on CPU (``Accelerator(cpu=True)``): the model with dropout, AdamW, a
StepLR scheduler and a ``DataLoader(shuffle=True, num_workers=2)`` over an augmenting dataset, all
prepared; ``ripresa.make_exact(loader)`` on the prepared loader (a ``DataLoaderShard``) and a
``Checkpointer``. One real child runs uninterrupted; another SIGKILLs itself after the optimizer step
that follows a mid-epoch checkpoint, and the same command again resumes it: the batches after the cut
and the final parameters equal the uninterrupted run's bit for bit. A prepared loader that was not made
exact is refused when the ``TrainingState`` is built, naming the fix — never at the first save.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EXAMPLES
from test_make_exact import (
    PER_EPOCH,
    Augmented,
    assert_bitwise,
    kill_and_resume,
    make_model,
    same,
    take,
)

import ripresa

pytest.importorskip("accelerate")

_ACCELERATE_CHILD = r'''
import json, os, random, signal, sys
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["here"])
import numpy as np, torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
import ripresa
from test_make_exact import Augmented, make_model

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=cfg.get("accum", 1), dataloader_config=DataLoaderConfiguration(
    use_seedable_sampler=cfg.get("seedable", False), dispatch_batches=cfg.get("dispatch", None)))
set_seed(0)
model = make_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
loader = torch.utils.data.DataLoader(Augmented(cfg["n"]), batch_size=cfg["batch"], shuffle=True,
                                     num_workers=cfg["workers"])
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
ripresa.make_exact(loader)
state = ripresa.TrainingState(model=model, optimizer=optimizer, scheduler=scheduler, data=loader)
ck = ripresa.Checkpointer(cfg["run"], state, every=cfg["every"], asynchronous=False)
step = start = ck.resume()
record = []
while step < cfg["steps"]:
    for x, y, idx in loader:
        with accelerator.accumulate(model):
            noise = 1 + 1e-3 * random.random() + 1e-3 * float(np.random.rand())
            loss = ((model(x) - y) ** 2).mean() * noise
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        record.append({"step": step, "x": x, "idx": idx})
        ck.step_done(step)
        if step == cfg.get("kill_after"):
            os.kill(os.getpid(), signal.SIGKILL)
        if step >= cfg["steps"]:
            break
ck.close()
torch.save({"start": start, "params": accelerator.unwrap_model(model).state_dict(), "record": record},
           cfg["out"] + ".0")
'''


def test_an_accelerate_loop_resumes_bitwise_after_sigkill(tmp_path):
    """Checkpoint at step 8 (epoch 1, batch 2), SIGKILL after step 10, the same command again."""
    reference, resumed = kill_and_resume(tmp_path, steps=16, every=4, kill_after=10, source=_ACCELERATE_CHILD)
    assert_bitwise(resumed, reference, cut=8)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [{"seedable": True}, {"dispatch": True}, {"accum": 2, "steps": 8, "every": 2}],
                         ids=["seedable_sampler", "dispatch_batches", "gradient_accumulation"])
def test_accelerate_variants_resume_bitwise(tmp_path, cfg):
    """accelerate's SeedableRandomSampler, its DataLoaderDispatcher (dispatch_batches=True), and
    gradient accumulation (2 micro-batches a step: the checkpoint at step 4 is 8 batches in, mid-epoch)."""
    run = {"steps": 15, "every": 5, **cfg}
    reference, resumed = kill_and_resume(tmp_path, kill_after=run["every"] + 2, source=_ACCELERATE_CHILD, **run)
    assert_bitwise(resumed, reference, cut=run["every"] * ((run["every"] + 2) // run["every"]))


def _prepared(**loader_kw):
    from accelerate import Accelerator

    loader = torch.utils.data.DataLoader(Augmented(), **{"batch_size": 4, "shuffle": True, **loader_kw})
    return Accelerator(cpu=True).prepare(loader)


def test_a_prepared_loader_not_made_exact_is_refused_at_construction_naming_the_fix(tmp_path):
    loader = _prepared()
    with pytest.raises(TypeError, match=r"accelerate's DataLoaderShard, not made exact.*ripresa\.make_exact\(loader\)"):
        ripresa.TrainingState(model=make_model(), data=loader)
    handle = ripresa.make_exact(loader)
    state = ripresa.TrainingState(model=make_model(), data=loader)
    assert state.data is handle
    head = take(loader, 3)
    with ripresa.Checkpointer(tmp_path / "run", state, every=0, asynchronous=False) as ck:
        ck.step_done(3)
        ck.save_now()  # the first save works (accelerate's own state_dict() failed here)
    again = _prepared()
    ripresa.make_exact(again)
    with ripresa.Checkpointer(tmp_path / "run", ripresa.TrainingState(model=make_model(), data=again)) as ck:
        assert ck.resume() == 3
        assert (again._ripresa_exact.epoch, again._ripresa_exact.cursor) == (0, 3)
        assert same(head + take(again, 2), take(_prepared_exact(handle.seed), 5))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from (torch.zeros(1) for _ in range(4))

    from accelerate import Accelerator

    stream = Accelerator(cpu=True).prepare(torch.utils.data.DataLoader(Stream(), batch_size=2))
    with pytest.raises(TypeError, match="IterableDataset"):
        ripresa.make_exact(stream)


@pytest.mark.slow
def test_a_prepared_loader_resumes_in_process_at_every_cut():
    reference = take(_prepared_exact(), 2 * PER_EPOCH + 1)
    for cut in range(2 * PER_EPOCH + 1):
        a = _prepared_exact()
        head = take(a, cut)
        b = _prepared_exact()
        b._ripresa_exact.load_state_dict(a._ripresa_exact.state_dict())
        assert same(head + take(b, 2 * PER_EPOCH + 1 - cut), reference), cut


def _prepared_exact(seed=None):
    torch.manual_seed(3)
    loader = _prepared(num_workers=0)
    ripresa.make_exact(loader, seed=seed)
    return loader


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four paths of real Trainer/accelerate processes: a hang guard on a shared machine
def test_steered_verify_of_the_unchanged_accelerate_example_passes_at_tolerance_zero(tmp_path):
    from test_hf_trainer import verify_steered

    res, report = verify_steered(EXAMPLES / "accelerate" / "train.py", tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert report["mode"] == "steered" and report["positive"] is True, report
    assert report["negative_divergence_detected"] is True


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four paths of real Trainer/accelerate processes: a hang guard on a shared machine
def test_steered_verify_fails_when_the_loader_is_left_out(tmp_path):
    """The negative variant: the prepared loader not made exact nor in the TrainingState (its draws not captured)."""
    from test_hf_trainer import verify_steered

    res, report = verify_steered(EXAMPLES / "accelerate" / "train.py", tmp_path, RIPRESA_EXAMPLE_LOADER_AS_IS="1")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert report["mode"] == "steered" and report["positive"] is False and report["all_checks_passed"] is False
    assert report["determinism_before_cut"]["passed"], report
    assert report["first_divergence"]["resume"] is not None
