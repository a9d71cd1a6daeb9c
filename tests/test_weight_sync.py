"""Weight sync transports (`ray`, `broadcast`, `shm`): real fsdp2 ranks, real HF engines as Ray actors,
real gloo groups. Same weights and log-probs either way; versions switch at the sync; a dead peer
is an error within seconds."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import ray
import torch
from torch.distributed import TCPStore
from transformers import AutoModelForCausalLM

from molt_core import weight_sync
from molt_core.config import TrainerConfig
from molt_core.engines.hf import HFEngine
from molt_core.rollout.client import EngineClient
from molt_core.policy.handle import Policy
from molt_core.policy.objective import TrainStep
from molt_core.weight_sync import WeightGroup, WeightSyncError
from molt_grpo import ppo_clip_loss

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 8, "stop_token_ids": []}
PROMPTS = [[5, 6, 7], [8, 9], [100, 101, 102, 103]]
TIMEOUT_S = 20.0
BUCKET = 20_000      # bytes: the tiny model goes in ~20 buckets


class ProbeEngine(HFEngine):
    """HFEngine plus a parameter read-out and an optional pause per bucket (tests only: it lets
    a test kill the engine while a sync is under way)."""

    def __init__(self, path: str, delay_s: float = 0.0, hold_generate_s: float = 0.0,
                 **kw) -> None:
        super().__init__(path, **kw)
        self.delay_s = delay_s
        self.hold_generate_s = hold_generate_s

    async def generate_batch(self, *args, **kw):
        await asyncio.sleep(self.hold_generate_s)   # keeps a request in flight for a kill
        return await super().generate_batch(*args, **kw)

    async def update_weights(self, named_tensors, version) -> None:
        await asyncio.sleep(self.delay_s)
        await super().update_weights(named_tensors, version)

    async def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def probe(path: str, **kw):
    return ray.remote(ProbeEngine).options(num_cpus=0).remote(path, seed=7, **kw)


def train_step(policy: Policy, seed: int) -> None:
    """One optimizer step on random rows (the weights move; what they learn does not matter)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 12
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 3:] = True
    batch = {"input_ids": torch.randint(1, 500, (B, T), generator=g),
             "attention_mask": torch.ones(B, T, dtype=torch.bool), "loss_mask": mask,
             "advantages": torch.randn(B, 1, generator=g).expand(B, T).clone() * mask,
             "behavior_logprobs": torch.full((B, T), -6.0) * mask,
             "versions": torch.zeros(B, T, dtype=torch.long)}
    policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean"))


def push(policy: Policy, engines: list, version: int, transport: str) -> dict:
    return weight_sync.push(policy.workers, engines, version, BUCKET, TIMEOUT_S, transport)


@pytest.fixture(scope="module")
def setup(ray_local, tiny_model_dir):
    """A 2-rank policy one optimizer step away from the checkpoint; engines A, B, C."""
    path = str(tiny_model_dir)
    engines = [probe(path) for _ in range(3)]
    policy = Policy(path, TrainerConfig(num_ranks=2, lr=1e-2, timeout_s=180.0))
    train_step(policy, 0)
    ray.get([e.get_version.remote() for e in engines], timeout=120)
    yield policy, engines
    policy.shutdown()
    for e in engines:
        ray.kill(e)


def group_pair(timeout_s: float, world: int = 2) -> tuple[WeightGroup, list]:
    """Rank 0 here; ranks 1.. in threads of this process (a real gloo group over loopback)."""
    store = TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=timeout_s),
                     wait_for_workers=False)
    pool = ThreadPoolExecutor(world - 1)
    peers = [pool.submit(WeightGroup, "127.0.0.1", store.port, r, world, "gloo", timeout_s)
             for r in range(1, world)]
    return WeightGroup("127.0.0.1", store.port, 0, world, "gloo", timeout_s, store), \
        [p.result(timeout=timeout_s) for p in peers]


def test_broadcast_keeps_bytes_and_dtypes():
    g = torch.Generator().manual_seed(0)
    bucket = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).bfloat16()),
              ("c", torch.arange(5)), ("d", torch.tensor(1.5, dtype=torch.float16)),
              ("e", torch.zeros(0, 4)), ("f", torch.randn(4, 4, generator=g).t())]
    root, (peer,) = group_pair(10.0)
    metas, flat = weight_sync.pack(bucket)
    assert all(off % 64 == 0 for *_, off in metas)
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(peer.receive, metas)
        root.broadcast(flat)
        received = got.result(timeout=10)
    assert [n for n, _ in received] == [n for n, _ in bucket]
    for (_, want), (_, have) in zip(bucket, received):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have, want)


def test_broadcast_to_a_silent_peer_times_out():
    root, (peer,) = group_pair(2.0)
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        root.broadcast(torch.zeros(1 << 20, dtype=torch.uint8))     # the peer never receives
    store = TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=2),
                     wait_for_workers=False)
    with pytest.raises(Exception, match="[Tt]ime"):
        WeightGroup("127.0.0.1", store.port, 0, 2, "gloo", 2.0, store)   # nobody joins


def test_transports_give_identical_weights_and_logprobs(setup):
    policy, (a, b, c) = setup
    stats = push(policy, [a, b], 1, "broadcast")
    assert stats["buckets"] > 5
    push(policy, [c], 1, "ray")
    trainer = policy.full_params()
    states = ray.get([e.state.remote() for e in (a, b, c)], timeout=60)
    # shm: engines a and b were given other weights first; many double-buffered buckets,
    # one of them larger than the slot it reuses (the embedding), fix them again
    ray.get([e.update_weights.remote([(k, torch.zeros_like(t)) for k, t in trainer.items()], 9)
             for e in (a, b)], timeout=60)
    ray.get([e.finish_weight_update.remote(9) for e in (a, b)], timeout=60)
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert push(policy, [a, b], 1, "shm")["buckets"] > 5
    assert push(policy, [a, b], 1, "shm")["buckets"] > 5       # the slots are reused
    if os.path.isdir("/dev/shm"):   # the files' names are gone, the mappings stay
        assert set(os.listdir("/dev/shm")) - before == set()
    states += ray.get([e.state.remote() for e in (a, b)], timeout=60)
    for state in states:
        assert state.keys() >= trainer.keys()
        for k, t in trainer.items():
            assert state[k].dtype == t.dtype and torch.equal(state[k], t), k
    # Same seed, same weights: the same samples and bit-identical log-probs.
    outs = [ray.get(e.generate_batch.remote(PROMPTS, [SAMPLING] * 3), timeout=60) for e in (a, c)]
    for x, y in zip(*outs):
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
        assert x.versions == [1] * len(x.token_ids)


def test_versions_switch_at_a_broadcast_sync(setup, tiny_model_dir):
    """A sync during a long generation: tokens before it carry v1 and v1 log-probs, after it v2
    and the trainer's new log-probs."""
    policy, (a, b, _) = setup
    push(policy, [a, b], 1, "broadcast")          # same group as before, or a new one: both fine
    v1 = policy.full_params()
    train_step(policy, 3)
    v2 = policy.full_params()
    before = ray.get(a.stats.remote(), timeout=60)["tokens_generated"]
    ref = a.generate.remote(PROMPTS[0], {**SAMPLING, "max_new_tokens": 300})
    # Hold the generation mid-way (as the partial scheme does at a sync), whatever the box's load.
    while ray.get(a.stats.remote(), timeout=60)["tokens_generated"] < before + 5:
        pass
    ray.get(a.pause.remote(), timeout=60)
    push(policy, [a, b], 2, "broadcast")
    ray.get(a.resume.remote(), timeout=60)
    c = ray.get(ref, timeout=120)
    k = c.versions.index(2) if 2 in c.versions else len(c.versions)
    assert 0 < k < len(c.versions), f"the sync did not land mid-generation (k={k})"
    assert c.versions == [1] * k + [2] * (len(c.versions) - k)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    ids = torch.tensor([PROMPTS[0] + c.token_ids])
    for weights, part in ((v1, slice(0, k)), (v2, slice(k, None))):
        model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            lp = model(ids).logits[0, len(PROMPTS[0]) - 1:-1].log_softmax(-1)
        lp = lp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        assert (lp[part] - torch.tensor(c.logprobs)[part]).abs().max() < 1e-4


@pytest.mark.parametrize("transport", ["ray", "broadcast", "shm"])
def test_engine_killed_before_a_sync(setup, tiny_model_dir, transport):
    policy, (a, _, _) = setup
    doomed = probe(str(tiny_model_dir))
    push(policy, [a, doomed], 3, transport)       # the broadcast group now includes `doomed`
    ray.kill(doomed)
    with pytest.raises(WeightSyncError, match="engine 1 .*died"):
        push(policy, [a, doomed], 4, transport)
    # The trainer ranks are still in step; the survivor may hold an open update to version 4:
    # pushing version 4 again completes it.
    push(policy, [a], 4, transport)
    assert ray.get(a.get_version.remote(), timeout=30) == 4


@pytest.mark.parametrize("transport", ["ray", "broadcast", "shm"])
def test_engine_killed_during_a_sync(setup, tiny_model_dir, transport):
    policy, (a, _, _) = setup
    slow = probe(str(tiny_model_dir), delay_s=0.2)
    ray.get(slow.get_version.remote(), timeout=60)
    killed = threading.Event()

    def kill_when_updating() -> None:
        while not ray.get(slow.stats.remote(), timeout=30)["updating"]:
            time.sleep(0.02)
        ray.kill(slow)
        killed.set()

    threading.Thread(target=kill_when_updating, daemon=True).start()
    with pytest.raises(WeightSyncError, match="engine 1 .*died"):
        push(policy, [a, slow], 6, transport)
    assert killed.is_set()
    push(policy, [a], 6, transport)


def test_engine_killed_during_generate(setup, tiny_model_dir):
    # the engine holds every request 10 min, so the kill lands while it is in flight however
    # fast the box decodes (400 free tokens finished inside 0.5 s on CI)
    doomed = probe(str(tiny_model_dir), hold_generate_s=600.0)
    ray.get(doomed.get_version.remote(), timeout=60)
    client = EngineClient([doomed], timeout_s=TIMEOUT_S)

    async def main():
        task = asyncio.ensure_future(client.generate(PROMPTS[0], SAMPLING))
        await asyncio.sleep(0.5)
        ray.kill(doomed)
        return await task

    # the error names the dead actor (a timeout would say "no engine answered")
    with pytest.raises(RuntimeError, match="engine 0 failed: .*Actor"):
        asyncio.run(main())


def test_config_transport_checks(tiny_model_dir):
    from molt_core.config import ConfigError, load_config
    base = [f"model.path={tiny_model_dir}"]
    assert load_config(None, base).trainer.weight_sync_transport == "broadcast"
    with pytest.raises(ConfigError, match="weight_sync_transport. must be one of broadcast, ray, shm, got .nccl."):
        load_config(None, [*base, "trainer.weight_sync_transport=nccl"])
    with pytest.raises(ConfigError, match="separate GPUs.*set trainer.weight_sync_transport=ray"):
        load_config(None, [*base, "engine.gpus_per_engine=0.5", "trainer.gpus_per_rank=0.5"])
    load_config(None, [*base, "engine.gpus_per_engine=0.5", "trainer.gpus_per_rank=0.5",
                       "trainer.weight_sync_transport=ray"])
