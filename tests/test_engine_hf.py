"""HFEngine: batched decode vs a from-scratch forward, stops, pause/update/resume, Ray actor."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from molt_core.engines.hf import HFEngine
from molt_core.trajectory import Completion

PROMPTS = [[5, 6, 7], [8] * 11, [71, 72], [100, 101, 102, 103, 104, 105], [300]]


def sampling(**kw) -> dict:
    return {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 8, "stop_token_ids": [], **kw}


def full_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] logits that predicted each sampled token, from one unpadded forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1: -1]


def assert_logprobs_match(model, prompt: list[int], c: Completion, temperature: float,
                          which: slice = slice(None)) -> None:
    lp = torch.log_softmax(full_logits(model, prompt, c.token_ids) / temperature, -1)
    ref = lp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)[which]
    got = torch.tensor(c.logprobs)[which]
    assert (ref - got).abs().max().item() < 1e-4


def perturbed(model, scale: float = 0.05, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g)
            for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_batched_logprobs_match_full_forward(tiny_model_dir, model, temperature):
    prompts = PROMPTS + [PROMPTS[1]] * 3      # a group: its prompt is prefilled once

    async def main():
        engine = HFEngine(str(tiny_model_dir))
        cs = await asyncio.gather(*[engine.generate(p, sampling(temperature=temperature))
                                    for p in prompts])
        return cs, await engine.stats()

    cs, stats = run(main())
    assert stats["batches"] == 1 and stats["prefills"] == 1  # one left-padded wave
    assert stats["prefill_tokens"] == sum(map(len, PROMPTS))
    assert stats["tokens_generated"] == 8 * len(prompts)
    for p, c in zip(prompts, cs):
        assert isinstance(c, Completion) and c.finish_reason == "length"
        assert len(c.token_ids) == 8 and c.versions == [0] * 8
        assert_logprobs_match(model, p, c, temperature)
    assert len({tuple(cs[i].token_ids) for i in (1, 5, 6, 7)}) > 1   # sampled apart


def test_samples_follow_the_distribution(tiny_model_dir):
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    engine = HFEngine(str(tiny_model_dir), seed=3)
    logits = probs.log().expand(40_000, 4).contiguous()
    tokens, logprobs = engine._sample(logits, torch.zeros(logits.shape, dtype=torch.bool),
                                      sampling(temperature=1.0))
    assert (torch.bincount(tokens, minlength=4) / len(tokens) - probs).abs().max() < 0.01
    torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_filters_shape_sampling_not_logprobs(tiny_model_dir, model):
    """top_k=1 is greedy on the penalised logits; the recorded log-prob stays log_softmax(z/T)."""
    s = sampling(top_k=1, top_p=0.9, min_p=0.05, max_new_tokens=6)

    async def main():
        engine = HFEngine(str(tiny_model_dir))
        return await asyncio.gather(*[engine.generate(p, s) for p in PROMPTS])

    cs = run(main())
    for p, c in zip(PROMPTS, cs):
        assert c.token_ids == full_logits(model, p, c.token_ids).argmax(-1).tolist()
        assert_logprobs_match(model, p, c, 0.7)
        assert max(c.logprobs) < 0.0


def test_repetition_penalty_and_low_temperature(tiny_model_dir, model):
    penalty, prompt = 1.3, [8] * 5 + [9]
    c = run(HFEngine(str(tiny_model_dir)).generate(
        prompt, sampling(temperature=1e-3, repetition_penalty=penalty, max_new_tokens=6)))
    logits = full_logits(model, prompt, c.token_ids)
    for i, tok in enumerate(c.token_ids):
        z = logits[i].clone()
        seen = torch.tensor(sorted(set(prompt + c.token_ids[:i])))
        z[seen] = torch.where(z[seen] > 0, z[seen] / penalty, z[seen] * penalty)
        assert tok == z.argmax().item()  # near-zero temperature: greedy on penalised logits
        ref = torch.log_softmax(z / 1e-3, -1)[tok].item()
        assert abs(ref - c.logprobs[i]) < 1e-3


def test_stop_token_and_lengths(tiny_model_dir):
    async def main():
        engine = HFEngine(str(tiny_model_dir))
        stop_all = await engine.generate([5, 6], sampling(stop_token_ids=list(range(512))))
        length = await engine.generate([5, 6], sampling(max_new_tokens=3))
        near_cap = await engine.generate([7] * 509, sampling(max_new_tokens=10))
        with pytest.raises(ValueError, match="max_position_embeddings"):
            await engine.generate([7] * 512, sampling())
        with pytest.raises(ValueError, match="missing \\['top_p'\\]"):
            await engine.generate([5], {k: v for k, v in sampling().items() if k != "top_p"})
        return stop_all, length, near_cap

    stop_all, length, near_cap = run(main())
    assert (len(stop_all.token_ids), stop_all.finish_reason) == (1, "stop")
    assert (len(length.token_ids), length.finish_reason) == (3, "length")
    assert (len(near_cap.token_ids), near_cap.finish_reason) == (3, "length")  # 509 + 3 = 512


def test_default_stop_ids_come_from_generation_config(tiny_model_dir):
    engine = HFEngine(str(tiny_model_dir))
    assert engine.default_stop_ids == {2, 0}  # <|im_end|>, <|endoftext|>


def test_same_seed_same_samples(tiny_model_dir):
    async def main(seed):
        engine = HFEngine(str(tiny_model_dir), seed=seed)
        return [c.token_ids for c in await asyncio.gather(
            *[engine.generate(p, sampling(temperature=1.0)) for p in PROMPTS])]

    assert run(main(0)) == run(main(0)) != run(main(1))


async def _wait_tokens(engine: HFEngine, n: int) -> None:
    while (await engine.stats())["tokens_generated"] < n:
        await asyncio.sleep(0)


def test_pause_update_resume_switches_version(tiny_model_dir, model):
    new = perturbed(model)
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    new_model.load_state_dict(new, strict=False)
    s = sampling(temperature=1.0, max_new_tokens=24)

    async def main():
        engine = HFEngine(str(tiny_model_dir))
        tasks = [asyncio.create_task(engine.generate(p, s)) for p in PROMPTS]
        await _wait_tokens(engine, 3 * len(PROMPTS))
        await engine.pause()
        frozen = (await engine.stats())["tokens_generated"]
        await asyncio.sleep(0.05)
        assert (await engine.stats())["tokens_generated"] == frozen
        assert not any(t.done() for t in tasks)
        items = list(new.items())
        await engine.update_weights(items[:5], version=1)
        await engine.update_weights(items[5:], version=1)
        await engine.finish_weight_update(1)
        await asyncio.sleep(0.02)
        assert (await engine.stats())["tokens_generated"] == frozen  # still paused
        assert await engine.get_version() == 1
        await engine.resume()
        return await asyncio.gather(*tasks), frozen // len(PROMPTS)

    cs, k = run(main())
    for p, c in zip(PROMPTS, cs):
        assert c.versions == [0] * k + [1] * (24 - k), c.versions
        # KV cache is rebuilt under new weights, so each token matches the weights that sampled it.
        assert_logprobs_match(model, p, c, 1.0, slice(0, k))
        assert_logprobs_match(new_model, p, c, 1.0, slice(k, None))


def test_first_bucket_blocks_decoding_until_finish(tiny_model_dir, model):
    new = list(perturbed(model).items())

    async def main():
        engine = HFEngine(str(tiny_model_dir))
        task = asyncio.create_task(engine.generate(PROMPTS[0], sampling(max_new_tokens=20)))
        await _wait_tokens(engine, 2)
        await engine.update_weights(new[:3], version=7)
        frozen = (await engine.stats())["tokens_generated"]
        await asyncio.sleep(0.05)
        assert (await engine.stats())["tokens_generated"] == frozen
        await engine.update_weights(new[3:], version=7)
        await engine.finish_weight_update(7)
        return await task, frozen

    c, k = run(main())
    assert c.versions == [0] * k + [7] * (20 - k)


def test_update_errors_name_the_parameter(tiny_model_dir, model):
    named = list(model.named_parameters())
    last = named[-1][0]

    async def main():
        engine = HFEngine(str(tiny_model_dir))
        with pytest.raises(ValueError, match="unknown parameter 'model.nope.weight'"):
            await engine.update_weights([("model.nope.weight", torch.zeros(1))], 1)
        with pytest.raises(ValueError, match=r"'model.norm.weight': engine has \(64,\)"):
            await engine.update_weights([("model.norm.weight", torch.zeros(3))], 1)
        with pytest.raises(ValueError, match="torch.float16"):
            await engine.update_weights([("model.norm.weight", torch.zeros(64).half())], 1)
        await engine.update_weights([(n, p.detach()) for n, p in named[:-1]], 1)
        with pytest.raises(RuntimeError, match=f"did not assign 1 parameter\\(s\\): {last}"):
            await engine.finish_weight_update(1)
        assert await engine.get_version() == 0
        # The tied alias lm_head.weight is accepted and counts for the embedding it shares.
        await engine.update_weights([(last, named[-1][1].detach())], 1)
        await engine.update_weights([("lm_head.weight", model.lm_head.weight.detach())], 1)
        await engine.finish_weight_update(1)
        assert await engine.get_version() == 1

    run(main())


def test_ray_actor(tiny_model_dir, model, ray_local):
    ray = ray_local
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(str(tiny_model_dir))
    try:
        refs = [engine.generate.remote(p, sampling()) for p in PROMPTS]
        cs = ray.get(refs, timeout=60)
        for p, c in zip(PROMPTS, cs):
            assert c.versions == [0] * 8
            assert_logprobs_match(model, p, c, 0.7)
        new = perturbed(model)
        ray.get(engine.pause.remote())
        ray.get(engine.update_weights.remote(list(new.items()), 3))
        ray.get(engine.finish_weight_update.remote(3))
        ray.get(engine.resume.remote())
        c = ray.get(engine.generate.remote(PROMPTS[0], sampling()), timeout=60)
        assert c.versions == [3] * 8
        stats = ray.get(engine.stats.remote())
        assert stats["requests"] == len(PROMPTS) + 1 and stats["version"] == 3
    finally:
        ray.kill(engine)


def test_cancelled_request_does_not_disturb_the_wave(tiny_model_dir):
    async def main():
        engine = HFEngine(str(tiny_model_dir))
        doomed = asyncio.create_task(engine.generate(PROMPTS[0], sampling(max_new_tokens=50)))
        kept = asyncio.create_task(engine.generate(PROMPTS[1], sampling(max_new_tokens=50)))
        await _wait_tokens(engine, 4)
        doomed.cancel()
        return await kept, await engine.stats()

    c, stats = run(main())
    assert len(c.token_ids) == 50 and stats["requests"] == 1
    assert stats["tokens_generated"] < 100
