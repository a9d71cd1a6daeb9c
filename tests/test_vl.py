"""Qwen3-VL policies: images in the prompt and in env turns, token-exact, engine == trainer.

Real components: a tiny random-init Qwen3-VL with its image processor built locally, the `hf`
engine's decode loop, the gym agent with the `colours` env, the trainer's `token_logprobs`.
"""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from molt_core import multimodal
from molt_core.engines.hf import HFEngine
from molt_core.contracts import RolloutContext
from molt_core.plugins import build_plugins
from molt_core.policy.logprobs import token_logprobs
from molt_core.trajectory import InvariantError, Trajectory, collate
from molt_gym import GymAgent

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                max_new_tokens=4)


@pytest.fixture(scope="module")
def tok(tiny_vl_dir):
    return AutoTokenizer.from_pretrained(tiny_vl_dir)


@pytest.fixture(scope="module")
def engine(tiny_vl_dir):
    return HFEngine(str(tiny_vl_dir))


def test_tiny_vl_model_processor_and_template(tiny_vl_dir, tok):
    cfg = AutoConfig.from_pretrained(tiny_vl_dir)
    text = cfg.get_text_config()
    assert cfg.model_type == "qwen3_vl" and text.head_dim >= 32 and text.dtype == torch.float32
    assert sum(text.rope_parameters["mrope_section"]) == text.head_dim // 2
    pad = tok.convert_ids_to_tokens(cfg.image_token_id)
    assert pad == "<|image_pad|>" and tok.encode(pad) == [cfg.image_token_id]
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": None},
                                      {"type": "text", "text": "colour?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>colour?"
                        "<|im_end|>\n<|im_start|>assistant\n")
    enc = multimodal.ImageEncoder(tiny_vl_dir, tok)
    image = np.full((32, 32, 3), 200, dtype=np.uint8)
    ids, images = enc.encode("a<|vision_start|><|image_pad|><|vision_end|>b", [image])
    (im,) = images
    assert im.grid_thw == [1, 4, 4] and im.num_tokens == 4 and im.pixel_values.shape == (16, 384)
    assert ids[im.start:im.start + 4] == [cfg.image_token_id] * 4
    assert tok.decode(ids) == "a<|vision_start|>" + pad * 4 + "<|vision_end|>b"
    with pytest.raises(ValueError, match="1 image placeholders .* but 2 images"):
        enc.encode("<|image_pad|>", [image, image])


def _rollouts(tiny_vl_dir, tok, engine, n: int, **env_args):
    """n concurrent two-turn rollouts (one engine wave: rows of different lengths)."""
    agent = GymAgent(SimpleNamespace(model=SimpleNamespace(path=str(tiny_vl_dir))), tok,
                     build_plugins(), env="colours", env_args={"turns": 2, **env_args},
                     max_turns=2)
    completions: dict[int, list[list[int]]] = {i: [] for i in range(n)}

    def generate_for(i):
        async def generate(prompt_ids, sampling=None, images=None):
            c = await engine.generate(prompt_ids, sampling or SAMPLING, images)
            completions[i].append(c.token_ids)
            return c
        return generate

    async def run():
        return await asyncio.gather(*(agent.rollout(RolloutContext(0, i, 100 + i, dict(SAMPLING),
                                                                   generate_for(i), tok))
                                      for i in range(n)))
    return asyncio.run(run()), completions


def test_vl_rollout_with_images_in_two_turns_is_token_exact_and_matches_trainer(
        tiny_vl_dir, tok, engine):
    trajs, completions = _rollouts(tiny_vl_dir, tok, engine, 6, prompt="colour?")
    cfg = AutoConfig.from_pretrained(tiny_vl_dir)
    for i, t in enumerate(trajs):
        t.check(len(tok))
        # Token identity: the trainable tokens are exactly the engine's, in order.
        assert [x for x, m in zip(t.token_ids, t.loss_mask) if m] == sum(completions[i], [])
        # One image per turn: the second image's placeholders come after the first reply.
        first, second = t.images
        first_reply = t.loss_mask.index(True)
        assert first.start < first_reply < second.start
        for im in t.images:
            span = t.token_ids[im.start - 1:im.start + im.num_tokens + 1]
            assert span == [cfg.vision_start_token_id, *[cfg.image_token_id] * 4,
                            cfg.vision_end_token_id]
            assert not any(t.loss_mask[im.start:im.start + im.num_tokens])
    assert len({len(t) for t in trajs}) > 1           # left padding inside the engine wave
    # Forward consistency: the trainer's forward (mRoPE positions from the same images) gives
    # the engine's behavior log-probs.
    batch = collate(trajs, [[0.0] * len(t) for t in trajs], tok.pad_token_id)
    model = multimodal.load_model(tiny_vl_dir, torch.float32).eval()
    blind_rows = {k: v for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw")}
    mask = batch["loss_mask"]
    with torch.no_grad():
        lp = token_logprobs(model, batch, 1.0, 1024).logprobs
        assert (lp - batch["behavior_logprobs"])[mask].abs().max() < 1e-5
        # Without the images (or with plain 1-D positions) the trainer would see another input.
        blind = token_logprobs(model, blind_rows, 1.0, 1024).logprobs
    assert (blind - batch["behavior_logprobs"])[mask].abs().max() > 1e-3


def test_mrope_positions_are_what_make_the_match(tiny_vl_dir, tok, engine):
    """Text positions after an image run are smaller than the token index (mRoPE); feeding the
    images with sequential positions changes the log-probs."""
    trajs, _ = _rollouts(tiny_vl_dir, tok, engine, 2, prompt="colour?")
    batch = collate(trajs, [[0.0] * len(t) for t in trajs], tok.pad_token_id)
    model = multimodal.load_model(tiny_vl_dir, torch.float32).eval()
    extra = multimodal.model_inputs(model, batch["input_ids"], batch["attention_mask"],
                                    *multimodal.unpack_rows(batch["pixel_values"],
                                                            batch["image_grid_thw"]))
    pos = extra.pop("position_ids")
    n = int(batch["attention_mask"][0].sum())
    assert (pos[1:, 0, n - 1] == n - 1 - 4).all()   # a 2x2-token image advances 2 positions
    with torch.no_grad():
        good = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=pos, **extra).logits
        naive = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=pos[0], **extra).logits
    assert (good - naive).abs().max() > 1e-3


def test_image_tokens_are_never_trainable_nor_sampled(tiny_vl_dir, tok, engine):
    (t,), _ = _rollouts(tiny_vl_dir, tok, engine, 1)
    t.loss_mask[t.images[1].start + 1] = True
    t.logprobs[t.images[1].start + 1], t.versions[t.images[1].start + 1] = -1.0, 0
    with pytest.raises(InvariantError, match="image placeholder tokens .* are trainable"):
        t.check(len(tok))
    # The engine masks vision special tokens: a hot sampler over many tokens never emits one.
    banned = set(multimodal.vision_token_ids(AutoConfig.from_pretrained(tiny_vl_dir)))
    hot = {**SAMPLING, "temperature": 5.0, "max_new_tokens": 64, "stop_token_ids": []}
    (image,) = t.images[:1]

    async def sample():
        prompt = t.token_ids[:image.start + image.num_tokens + 1]
        return await asyncio.gather(*(engine.generate(prompt, hot, [image]) for _ in range(8)))
    sampled = {x for c in asyncio.run(sample()) for x in c.token_ids}
    assert len(sampled) > 20 and not sampled & banned


def test_text_only_engine_rejects_images(tiny_model_dir, tiny_vl_dir, tok, engine):
    (t,), _ = _rollouts(tiny_vl_dir, tok, engine, 1)
    text_engine = HFEngine(str(tiny_model_dir))
    with pytest.raises(ValueError, match="takes no images"):
        asyncio.run(text_engine.generate([1, 2, 3], SAMPLING, t.images))
    with pytest.raises(ValueError, match="8 image placeholder tokens but its 1 images fill 4"):
        asyncio.run(engine.generate(t.token_ids, SAMPLING, t.images[:1]))



def _data_uri(rgb) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_message(rgb, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_uri(rgb)}},
                                        {"type": "text", "text": text}]}


def recording(engine):
    """A generate function over `engine` that records (number of images, sampled ids) per call."""
    calls = []

    async def generate(prompt_ids, sampling, images=None):
        c = await engine.generate(prompt_ids, sampling, images)
        calls.append((len(images or []), c.token_ids))
        return c
    return calls, generate


def test_openai_sdk_image_url_data_uris_in_two_turns(tiny_vl_dir, tok, engine):
    """The real openai SDK sends images as data URIs in two turns: they ride with the
    trajectory, the replies are the engine's tokens, and the trainer's log-probs match."""
    import openai

    from molt_core.chat.server import ChatServer

    calls, generate = recording(engine)

    async def main():
        server = ChatServer()
        await server.start()
        s = server.open_session(tok, generate, {**SAMPLING, "max_new_tokens": 6},
                                max_context=256)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        messages = [_image_message((200, 30, 30), "colour?")]
        for rgb in [(30, 30, 200), None]:
            r = await client.chat.completions.create(model="policy", messages=messages)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            if rgb:
                messages.append(_image_message(rgb, "and now?"))
        bad = [{"role": "user", "content": [{"type": "image_url",
                                             "image_url": {"url": "https://example.com/a.png"}}]}]
        with pytest.raises(openai.BadRequestError, match="base64 data URI"):
            await client.chat.completions.create(model="policy", messages=bad)
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return traj

    traj = asyncio.run(main())
    traj.check(len(tok))
    assert traj.segments == [0] and [n for n, _ in calls] == [1, 2]
    assert [x for x, m in zip(traj.token_ids, traj.loss_mask) if m] == calls[0][1] + calls[1][1]
    assert len(traj.images) == 2 and traj.images[1].start > traj.loss_mask.index(True)
    batch = collate([traj], [[0.0] * len(traj)], tok.pad_token_id)
    model = multimodal.load_model(tiny_vl_dir, torch.float32).eval()
    with torch.no_grad():
        lp = token_logprobs(model, batch, 1.0, 1024).logprobs
    mask = batch["loss_mask"]
    assert (lp - batch["behavior_logprobs"])[mask].abs().max() < 1e-5


def test_chat_server_refuses_images_for_a_text_only_model(tiny_model_dir):
    import openai

    from molt_core.chat.server import ChatServer

    text_tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def main():
        server = ChatServer()
        await server.start()
        s = server.open_session(text_tok, None, SAMPLING, max_context=256)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        try:
            with pytest.raises(openai.BadRequestError, match="takes no images"):
                await client.chat.completions.create(
                    model="policy", messages=[_image_message((0, 0, 0), "hi")])
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())


def test_engine_vllm_with_a_vl_checkpoint_is_rejected_with_the_reason(tiny_vl_dir, tmp_path):
    import yaml

    from molt_core.cli import load
    from molt_core.config import ConfigError

    data = yaml.safe_load(open("recipes/cpu/vl_colour.yaml"))
    data["model"]["path"] = str(tiny_vl_dir)
    data["engine"]["name"] = "vllm"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load(str(path), [])
    msg = str(e.value)
    assert "use engine.name=hf" in msg and str(tiny_vl_dir) in msg
    assert "need torchvision" in msg and "libc10_cuda.so" in msg
    assert "['Qwen3VLForConditionalGeneration'] failed to be inspected" in msg


def test_anthropic_sdk_base64_image_block(tiny_vl_dir, tok, engine):
    import anthropic

    from molt_core.chat.server import ChatServer

    calls, generate = recording(engine)

    async def main():
        server = ChatServer()
        await server.start()
        s = server.open_session(tok, generate, SAMPLING, max_context=256)
        client = anthropic.AsyncAnthropic(base_url=s.anthropic_base_url, api_key=s.api_key,
                                          max_retries=0)
        data = _data_uri((30, 200, 30)).partition(",")[2]
        await client.messages.create(model="policy", max_tokens=4, messages=[{
            "role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": data}},
                {"type": "text", "text": "colour?"}]}])
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return traj

    traj = asyncio.run(main())
    traj.check(len(tok))
    assert [n for n, _ in calls] == [1] and len(traj.images) == 1
    assert [x for x, m in zip(traj.token_ids, traj.loss_mask) if m] == calls[0][1]


def test_weight_update_mid_generation_reprefills_with_the_images(tiny_vl_dir, tok):
    """A weight update under in-flight VL requests: the re-prefill feeds the images again (through
    the new vision tower) with the same mRoPE positions, so every token's log-prob is that of the
    weights that sampled it."""
    model = multimodal.load_model(tiny_vl_dir, torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
           for n, p in model.named_parameters()}
    new_model = multimodal.load_model(tiny_vl_dir, torch.float32).eval()
    new_model.load_state_dict(new, strict=False)
    enc = multimodal.ImageEncoder(tiny_vl_dir, tok)
    image = np.full((32, 32, 3), 90, dtype=np.uint8)
    prompts = [enc.encode(text, [image] * text.count("<|image_pad|>")) for text in
               ["<|vision_start|><|image_pad|><|vision_end|>a",
                "long text then <|vision_start|><|image_pad|><|vision_end|>b<|vision_start|>"
                "<|image_pad|><|vision_end|>c"]]
    s = {**SAMPLING, "max_new_tokens": 12, "stop_token_ids": []}

    async def main():
        engine = HFEngine(str(tiny_vl_dir))
        tasks = [asyncio.create_task(engine.generate(ids, s, ims)) for ids, ims in prompts]
        while (await engine.stats())["tokens_generated"] < 3 * len(prompts):
            await asyncio.sleep(0.002)
        await engine.pause()
        k = (await engine.stats())["tokens_generated"] // len(prompts)
        await engine.update_weights(list(new.items()), version=1)
        await engine.finish_weight_update(1)
        await engine.resume()
        return await asyncio.gather(*tasks), k

    completions, k = asyncio.run(main())
    for (ids, ims), c in zip(prompts, completions):
        assert c.versions == [0] * k + [1] * (12 - k)
        t = Trajectory()
        t.add_prompt(ids, ims)
        t.add_completion(c)
        batch = collate([t], [[0.0] * len(t)], tok.pad_token_id)
        with torch.no_grad():
            old_lp = token_logprobs(model, batch, 1.0, 1024).logprobs[0, len(ids):]
            new_lp = token_logprobs(new_model, batch, 1.0, 1024).logprobs[0, len(ids):]
        engine_lp = torch.tensor(c.logprobs)
        assert (old_lp - engine_lp)[:k].abs().max() < 1e-5
        assert (new_lp - engine_lp)[k:].abs().max() < 1e-5
        assert (old_lp - engine_lp)[k:].abs().max() > 1e-3
