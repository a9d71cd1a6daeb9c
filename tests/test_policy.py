"""fsdp2 trainer backend and weight push: real Ray actors, real gloo process groups, tiny Qwen3."""

from __future__ import annotations

import sys
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from molt_core.algos import masked_mean
from molt_core.config import TrainerConfig
from molt_core.policy import Policy

# Workers cannot import this test module: ship its functions (the loss) by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

B_ROWS = 7          # odd: the 2-rank policy pads one dummy row


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return str(tiny_model_dir)


def ppo_clip(logprobs, behavior_logprobs, advantages, mask, clip: float = 0.2):
    ratio = torch.exp(logprobs - behavior_logprobs)
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return per_token, {"clipfrac": ((ratio - 1).abs() > clip).float(),
                       "ratio_mean": masked_mean(ratio.detach(), mask)}


def reference_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Plain full-vocab forward of an unsharded HF model: [B, T], 0 where not trainable."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    out = torch.zeros(batch["input_ids"].shape)
    out[:, 1:] = lp
    return out * batch["loss_mask"]


def make_batch(model_path: str, B: int = B_ROWS, T: int = 20, seed: int = 0
               ) -> dict[str, torch.Tensor]:
    """Right-padded rows of different lengths; row 1 has no trainable token."""
    g = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long),
             "attention_mask": torch.zeros(B, T, dtype=torch.bool),
             "loss_mask": torch.zeros(B, T, dtype=torch.bool),
             "advantages": torch.zeros(B, T), "versions": torch.full((B, T), -1)}
    for i in range(B):
        n = T - (3 * i) % 11
        prompt = 2 + i % 4
        batch["input_ids"][i, :n] = torch.randint(1, 500, (n,), generator=g)
        batch["attention_mask"][i, :n] = True
        if i != 1:
            batch["loss_mask"][i, prompt:n] = True
        batch["advantages"][i, :n] = torch.randn((), generator=g)
    batch["versions"][batch["loss_mask"]] = 0
    ref = reference_logprobs(AutoModelForCausalLM.from_pretrained(model_path), batch)
    noise = 0.05 * torch.randn(B, T, generator=g)
    batch["behavior_logprobs"] = (ref + noise).clamp(max=0) * batch["loss_mask"]
    return batch


def start(model_path: str, **trainer) -> Policy:
    return Policy(model_path, TrainerConfig(**{"lr": 1e-3, "timeout_s": 60.0,
                                               "weight_sync_transport": "ray", **trainer}))


def assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max parameter difference {worst}"


@ray.remote(num_cpus=0)
class StandInEngine:
    """Stand-in for `molt_core.engines.hf.HFEngine` until it lands: the same HF model and the same
    `update_weights` / `finish_weight_update` contract (coverage-checked, dtype-preserving)."""

    def __init__(self, model_path: str, stall_s: float = 0.0):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.params = dict(self.model.named_parameters())
        self.stall_s, self.version, self.updated, self.dtypes = stall_s, -1, set(), {}

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        time.sleep(self.stall_s)
        with torch.no_grad():
            for name, t in named_tensors:
                self.params[name].copy_(t)
                self.updated.add(name)
                self.dtypes[name] = t.dtype

    def finish_weight_update(self, version: int) -> None:
        missing = self.params.keys() - self.updated
        if missing:
            raise RuntimeError(f"weight update {version} missed {sorted(missing)}")
        self.version, self.updated = version, set()

    def state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.dtype]]:
        return self.version, {k: v.detach().clone() for k, v in self.params.items()}, self.dtypes


@pytest.fixture(scope="module")
def cluster(ray_local, model_path):
    """Started together (actor start-up is mostly imports): three policies and two engines.

    one: 1 rank, one micro-batch; micro: 1 rank, micro-batches of 3 rows; two: 2 ranks, one row
    per micro-batch (so some micro-batches hold no trainable token), lm_head chunks of 3 tokens.
    """
    engines = [StandInEngine.remote(model_path) for _ in range(2)]
    policies = {"one": start(model_path, micro_batch_size=64),
                "micro": start(model_path, micro_batch_size=3, weight_sync_timeout_s=1.0),
                "two": start(model_path, num_ranks=2, micro_batch_size=1, logprob_chunk=3,
                             weight_sync_bucket_mb=0.05)}
    ray.get([e.state.remote() for e in engines])
    yield policies, engines
    for p in policies.values():
        p.shutdown()
    for e in engines:
        ray.kill(e)


TRAINED_LP: dict[str, list] = {}     # policy -> [(logprobs before train, trained_logprobs)]


@pytest.fixture(scope="module")
def trained(cluster, model_path):
    """Two identical optimizer steps on every policy (token-mean, then seq-mean-token-mean)."""
    policies, _ = cluster
    metrics = {name: [] for name in policies}
    for seed, agg in ((0, "token-mean"), (1, "seq-mean-token-mean")):
        batch = make_batch(model_path, seed=seed)
        for name, p in policies.items():
            before = p.logprobs(batch)
            metrics[name].append(p.train(batch, ppo_clip, {"clip": 0.2}, agg))
            TRAINED_LP.setdefault(name, []).append((before, p.trained_logprobs()()))
    params = {name: p.full_params() for name, p in policies.items()}
    return metrics, params


def test_two_ranks_match_one_rank(trained):
    metrics, params = trained
    for m1, m2 in zip(metrics["one"], metrics["two"]):
        for k in ("loss", "grad_norm", "clipfrac", "ratio_mean", "mismatch/kl", "mismatch/max_abs"):
            assert m1[k] == pytest.approx(m2[k], abs=1e-5), k
        assert {"train/fwd_bwd_s", "train/optim_s"} <= m1.keys()
    assert 0 < metrics["one"][0]["mismatch/max_abs"] < 0.3          # the injected noise
    assert_params_close(params["one"], params["two"])


def test_trained_logprobs_are_what_the_step_trained_with(trained):
    """What the trajectory store saves: the pre-update log-probs, across ranks and micro-batches."""
    for name, pairs in TRAINED_LP.items():
        for before, got in pairs:
            assert got.shape == before.shape, name
            assert torch.allclose(got, before, atol=1e-5), name
            assert (got != 0).any()


def test_micro_batches_do_not_change_the_update(trained):
    metrics, params = trained
    for m1, m3 in zip(metrics["one"], metrics["micro"]):
        for k in ("loss", "grad_norm"):     # Adam hides gradient scale: compare the norm too
            assert m1[k] == pytest.approx(m3[k], abs=1e-6), k
    assert_params_close(params["one"], params["micro"])


def test_chunked_logprobs_match_full_forward(cluster, trained, model_path):
    policies, _ = cluster
    batch = make_batch(model_path, seed=2)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(trained[1]["two"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}     # tied to embed_tokens
    ref = reference_logprobs(model, batch)
    lp = policies["two"].logprobs(batch)
    assert lp.shape == ref.shape
    assert (lp[~batch["loss_mask"]] == 0).all()
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_push_weights_after_training(cluster, trained):
    policies, engines = cluster
    t0 = time.perf_counter()
    stats = policies["two"].push_weights(engines, version=2)
    print(f"push: {stats} ({time.perf_counter() - t0:.3f}s incl. RPC)")
    assert stats["buckets"] > 1
    trainer = trained[1]["two"]
    for e in engines:
        version, params, dtypes = ray.get(e.state.remote())
        assert version == 2
        assert params.keys() == trainer.keys()
        assert all(dtypes[k] == trainer[k].dtype for k in trainer)
        assert_params_close(params, trainer, atol=0.0)


def test_push_to_stalled_engine_times_out_clearly(cluster, model_path):
    policies, engines = cluster
    stalled = StandInEngine.remote(model_path, stall_s=60.0)
    try:
        ray.get(stalled.state.remote())
        with pytest.raises(TimeoutError, match=r"engine 1 .*update_weights.*within 1.0s"):
            policies["micro"].push_weights([engines[0], stalled], version=3)
    finally:
        ray.kill(stalled)
