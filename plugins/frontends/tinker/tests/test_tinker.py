"""The real `tinker` SDK against `molt serve-tinker` on loopback: the service's endpoints, the
training loops of the cookbook's shape, Molt's own losses as the numerical reference, bad
requests."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tinker
from tinker import types


def test_molt_cli_commands_adds_serve_tinker():
    """The plugin's `molt_cli_commands` hook gives `molt serve-tinker`; core commands stay."""
    from molt_tools.commands import COMMANDS, plugin_commands
    commands = plugin_commands()
    assert commands["serve-tinker"][2] == "molt_tinker.server:main"
    assert {k: commands[k] for k in COMMANDS} == COMMANDS
    out = subprocess.run([sys.executable, "-m", "molt_tools", "serve-tinker", "-h"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--session-timeout" in out.stdout, out.stderr[-2000:]


def test_health_capabilities_and_a_session(server: str):
    rest = tinker.RestClient()
    caps = rest.get_server_capabilities().result()
    (model,) = caps.supported_models
    assert model.trainable and model.sampleable and model.max_context_length > 0
    with tinker.ServiceClient() as service:
        tc = service.create_lora_training_client(base_model=model.model_name, rank=4).result()
        info = tc.get_info()
        assert info.is_lora and info.lora_rank == 4 and info.model_data.model_name == model.model_name
        tok = tc.get_tokenizer()            # offline: the tokenizer id is the local model dir
        assert tok.decode(tok.encode("abc")) == "abc"


def _base() -> str:
    # the URL given, not left to the env: the SDK keeps one REST client per (URL argument, key)
    # for the process, so an env-derived one made while another server was the default sticks
    url = os.environ["TINKER_BASE_URL"]
    return tinker.RestClient(base_url=url).get_server_capabilities().result().supported_models[0].model_name


def _datum(tokens: list[int], **per_target: list[float]) -> types.Datum:
    """Tinker's standard datum: input tokens[:-1], targets tokens[1:], inputs per target."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **per_target})


CHATS = [("what is 2+2?", "4"), ("say hi", "hi!"), ("spell cat", "c-a-t"), ("count to 3", "1 2 3")]


def test_supervised_loop_on_chat_data_lowers_the_loss(server: str):
    """The cookbook's SL loop: chat rows rendered by the chat template, weights on the reply,
    forward_backward(cross_entropy) + optim_step; the mean NLL per reply token falls."""
    with tinker.ServiceClient() as service:
        tc = service.create_lora_training_client(base_model=_base(), rank=8, seed=1).result()
        tok = tc.get_tokenizer()
        data = []
        for q, a in CHATS:
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
            p, c = tok.encode(prompt), tok.encode(a + "<|im_end|>")
            data.append(_datum(p + c, weights=[0.0] * (len(p) - 1) + [1.0] * len(c)))
        nll = []
        for _ in range(10):
            fb = tc.forward_backward(data, "cross_entropy")
            step = tc.optim_step(types.AdamParams(learning_rate=5e-3))
            out = fb.result()
            step.result()
            lp = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
            w = np.concatenate([d.loss_fn_inputs["weights"].to_numpy() for d in data])
            nll.append(float(-(lp * w).sum() / w.sum()))
            assert out.metrics["loss:sum"] == pytest.approx(float(-(lp * w).sum()), rel=1e-4)
    assert nll[-1] < 0.85 * nll[0] and sum(b < a for a, b in zip(nll, nll[1:])) >= 8, nll


def _molt_batch(rows: list[tuple[list[int], list[float], list[float] | None]], mask_zero: bool
                ) -> dict:
    """Molt's own [B, T] batch of the same rows (tokens, per-target weight, sampler log-probs):
    position t holds the log-prob of token t, so target i is at t = i + 1."""
    import torch
    B, T = len(rows), max(len(r[0]) for r in rows)
    b = {"input_ids": torch.zeros(B, T, dtype=torch.long),
         "attention_mask": torch.zeros(B, T, dtype=torch.bool),
         "loss_mask": torch.zeros(B, T, dtype=torch.bool), "advantages": torch.zeros(B, T),
         "behavior_logprobs": torch.zeros(B, T), "versions": torch.zeros(B, T, dtype=torch.long)}
    for i, (ids, w, q) in enumerate(rows):
        n = len(ids)
        b["input_ids"][i, :n], b["attention_mask"][i, :n] = torch.tensor(ids), True
        b["advantages"][i, 1:n] = torch.tensor(w)
        b["loss_mask"][i, 1:n] = torch.tensor(w) != 0 if mask_zero else True
        if q is not None:
            b["behavior_logprobs"][i, 1:n] = torch.tensor(q)
    return b


def test_forward_backward_equals_molt_losses_loss_and_gradients(server: str, tiny_chars):
    """cross_entropy == Molt's SFT nll and importance_sampling == Molt's RL objective (ppo_clip
    against pi_prox with the behavior policy's token IS correction, tis uncapped) on the same
    rows and LoRA init: the same loss, gradient norm and weights after each Adam step (Molt's
    seq-mean-token-sum over the 2 rows is Tinker's sum / 2)."""
    import math

    from molt_core.config import LoraConfig, TrainerConfig
    from molt_core.policy.handle import Policy
    from molt_core.policy.objective import TrainStep
    from molt_core.sft_trainer import nll
    from molt_grpo import ppo_clip_loss

    seqs = [[5, 9, 14, 22, 7, 3, 30], [11, 4, 8, 40, 2]]
    g = np.random.default_rng(0)
    weights = [[0.0, 0.0] + [1.0] * (len(s) - 3) for s in seqs]
    adv = [g.choice([-1.0, 1.0], len(s) - 1).tolist() for s in seqs]
    adam = types.AdamParams(learning_rate=1e-2)
    with tinker.ServiceClient() as service:
        tc = service.create_lora_training_client(base_model=_base(), rank=4, seed=7).result()
        ce = tc.forward_backward([_datum(s, weights=w) for s, w in zip(seqs, weights)],
                                 "cross_entropy").result()
        ce_step = tc.optim_step(adam).result()
        q = [(o["logprobs"].to_numpy() - 0.3 * g.random(len(s) - 1)).tolist()
             for o, s in zip(ce.loss_fn_outputs, seqs)]
        is_ = tc.forward_backward([_datum(s, logprobs=lq, advantages=a)
                                   for s, lq, a in zip(seqs, q, adv)],
                                  "importance_sampling").result()
        is_step = tc.optim_step(adam).result()
        after = tc.forward([_datum(s, weights=w) for s, w in zip(seqs, weights)],
                           "cross_entropy").result()

    policy = Policy(str(tiny_chars), TrainerConfig(
        lr=adam.learning_rate, betas=[adam.beta1, adam.beta2], eps=adam.eps, grad_clip=math.inf,
        timeout_s=60.0, lora=LoraConfig(rank=4)), seed=7)
    try:
        m_ce = policy.train(_molt_batch([(s, w, None) for s, w in zip(seqs, weights)], True),
                            TrainStep(nll, loss_agg="seq-mean-token-sum"))
        m_is = policy.train(_molt_batch(list(zip(seqs, adv, q)), False), TrainStep(
            ppo_clip_loss, loss_agg="seq-mean-token-sum", correction="tis",
            correction_args={"cap": math.inf}))
        lp_after = policy.logprobs(_molt_batch([(s, w, None) for s, w in zip(seqs, weights)],
                                               False))
    finally:
        policy.shutdown()
    assert ce.metrics["loss:sum"] == pytest.approx(2 * m_ce["loss"], rel=1e-4)
    assert ce_step.metrics["grad_norm"] == pytest.approx(2 * m_ce["grad_norm"], rel=1e-4)
    assert is_.metrics["loss:sum"] == pytest.approx(2 * m_is["loss"], rel=1e-4)
    assert is_step.metrics["grad_norm"] == pytest.approx(2 * m_is["grad_norm"], rel=1e-4)
    for o, s, row in zip(after.loss_fn_outputs, seqs, lp_after):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), row[1:len(s)].numpy(), atol=1e-4)


GOOD = set("abcdefghijklmnop")  # the trivial task: answer with one of these letters
RL_STEPS, RL_LR = 15, 0.2


def _reward(tok, tokens: list[int]) -> float:
    return float(tok.decode(tokens).strip()[:1] in GOOD and len(tokens) > 0)


def _mean_reward(sampler, tok, prompts: list[list[int]], n: int) -> float:
    params = types.SamplingParams(max_tokens=1, temperature=1.0, seed=123)
    futures = [sampler.sample(types.ModelInput.from_ints(p), n, params) for p in prompts]
    return float(np.mean([_reward(tok, s.tokens) for f in futures for s in f.result().sequences]))


def test_rl_loop_importance_sampling_raises_the_held_out_reward(server: str):
    """The cookbook's rl_loop shape: a sampler from the latest weights, groups of samples per
    prompt, reward, advantages centred per group, importance_sampling on the sampler's
    log-probs, optim_step; the mean reward on held-out prompts rises."""
    with tinker.ServiceClient() as service:
        tc = service.create_lora_training_client(base_model=_base(), rank=8, seed=3).result()
        tok = tc.get_tokenizer()
        train = [tok.encode(f"q{i}:") for i in range(8)]
        held = [tok.encode(f"q{i}:") for i in range(8, 16)]
        before = _mean_reward(tc.save_weights_and_get_sampling_client().result(), tok, held, 16)
        for step in range(RL_STEPS):
            sampler = tc.save_weights_and_get_sampling_client().result()
            futures = [(p, sampler.sample(types.ModelInput.from_ints(p), 8, types.SamplingParams(
                max_tokens=1, temperature=1.0, seed=1000 * step + i))) for i, p in enumerate(train)]
            data = []
            for prompt, fut in futures:
                seqs = fut.result().sequences
                rewards = [_reward(tok, s.tokens) for s in seqs]
                mean = sum(rewards) / len(rewards)
                for s, r in zip(seqs, rewards):
                    if r == mean or not s.tokens:       # a flat group teaches nothing
                        continue
                    ob = len(prompt) - 1
                    data.append(_datum(prompt + s.tokens, logprobs=[0.0] * ob + s.logprobs,
                                       advantages=[0.0] * ob + [r - mean] * len(s.tokens)))
            if data:
                tc.forward_backward(data, "importance_sampling")
                tc.optim_step(types.AdamParams(learning_rate=RL_LR)).result()
        after = _mean_reward(tc.save_weights_and_get_sampling_client().result(), tok, held, 16)
    print(f"held-out reward {before:.3f} -> {after:.3f}")
    assert after >= before + 0.1, (before, after)      # measured: 0.391 -> 0.547


def test_bad_requests_get_the_sdks_errors_and_the_server_goes_on(server: str,
                                                                session_timeout: float):
    """Unknown base model and model id, wrong tensor shapes, an unknown future and an expired
    session each get the SDK's error type; the live training client keeps training."""
    import asyncio
    import time

    async def raw() -> None:
        from tinker._client import AsyncTinker
        client = AsyncTinker(base_url=server)
        with pytest.raises(tinker.NotFoundError, match="unknown model 'nope'"):
            await client.models.get_info(request=types.GetInfoRequest(model_id="nope"))
        with pytest.raises(tinker.NotFoundError, match="unknown future 'nope'"):
            await client.futures.retrieve(request=types.FutureRetrieveRequest(request_id="nope"))
        sid = (await client.service.create_session(request=types.CreateSessionRequest(
            tags=[], user_metadata=None, sdk_version=tinker.__version__))).session_id
        await asyncio.sleep(session_timeout + 1)      # no heartbeat: the session expires
        with pytest.raises(tinker.APIStatusError, match="expired") as gone:
            await client.service.session_heartbeat(session_id=sid)
        assert gone.value.status_code == 410
        with pytest.raises(tinker.APIStatusError, match="expired"):
            await client.models.create(request=types.CreateModelRequest(
                session_id=sid, model_seq_id=0, base_model=_base(),
                lora_config=types.LoraConfig(rank=4)))
        await client.close()

    seq = [3, 7, 9, 12, 5]
    with tinker.ServiceClient() as service:
        with pytest.raises(tinker.BadRequestError, match="unknown base model 'Qwen/Qwen3-8B'"):
            service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
        tc = service.create_lora_training_client(base_model=_base(), rank=4).result()
        with pytest.raises(tinker.RequestFailedError, match=r"'weights'\] has shape \[2\]") as e:
            tc.forward_backward([_datum(seq, weights=[1.0, 1.0])], "cross_entropy").result()
        assert e.value.category == types.RequestErrorCategory.User
        with pytest.raises(tinker.RequestFailedError, match="lacks 'advantages'"):
            tc.forward_backward([_datum(seq, logprobs=[0.0] * 4)], "ppo").result()
        asyncio.run(raw())
        t0 = time.monotonic()
        out = tc.forward_backward([_datum(seq, weights=[1.0] * 4)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert out.metrics["loss:sum"] > 0 and time.monotonic() - t0 < 600


def test_sampling_stop_sequences_prompt_logprobs_and_checkpoints(server: str):
    """Stop token ids and stop strings end a sample (stop_reason "stop"), max_tokens gives
    "length"; prompt log-probs equal the trainer's; save_state / load_state_with_optimizer
    restore the weights (and create_training_client_from_state makes a new model of them)."""
    with tinker.ServiceClient() as service:
        tc = service.create_lora_training_client(base_model=_base(), rank=4, seed=2).result()
        tok = tc.get_tokenizer()
        seq = tok.encode("abcabcab")
        data = [_datum(seq, weights=[1.0] * (len(seq) - 1))]
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = tc.save_state("two-steps").result().path
        trained = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(seq)
        plain = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=5),
                               include_prompt_logprobs=True).result()
        assert all(s.stop_reason == "length" and len(s.tokens) == 6 for s in plain.sequences)
        assert plain.prompt_logprobs[0] is None
        np.testing.assert_allclose(plain.prompt_logprobs[1:], trained, atol=1e-4)
        for s in plain.sequences:
            assert len(s.logprobs) == 6 and all(lp <= 0 for lp in s.logprobs)
        first = plain.sequences[0].tokens
        by_id = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=5,
                                                              stop=[first[2]])).result()
        assert by_id.sequences[0].tokens == first[:3] and by_id.sequences[0].stop_reason == "stop"
        text = tok.decode(first[:2])
        by_str = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=5,
                                                               stop=[text])).result()
        assert tok.decode(by_str.sequences[0].tokens).endswith(text)
        assert by_str.sequences[0].stop_reason == "stop"
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-1)).result()
        moved = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert np.abs(moved - trained).max() > 1e-3
        tc.load_state_with_optimizer(saved).result()
        back = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(back, trained, atol=1e-5)
    with tinker.ServiceClient() as service:
        tc = service.create_training_client_from_state_with_optimizer(saved).result()
        again = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(again, trained, atol=1e-5)


def _train(tc, data: list[types.Datum], steps: int) -> list[float]:
    """`steps` rounds of forward_backward(cross_entropy) + optim_step; the losses."""
    out = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        out.append(fb.result().metrics["loss:sum"])
    return out


def test_several_training_clients_interleaved_train_as_if_alone(server: str):
    """Three live training clients on one server: A and C (LoRA rank 8) in one session, B (another
    seed) in another, their requests interleaved (A.fb, B.fb, A.optim, B.optim, ...), so the one
    trainer swaps their states at every switch. Each one's losses equal (fp32, 1e-6) those of the
    same client trained alone afterwards. B's session closes: B is freed (NotFoundError) and A
    goes on training."""
    import asyncio

    from tinker._client import AsyncTinker

    def data(text: str) -> list[types.Datum]:
        return [_datum([ord(ch) % 50 + 3 for ch in t], weights=[1.0] * (len(t) - 1))
                for t in (text, text[::-1] + "xy")]
    da, db, dc = data("abcabcabd"), data("zyxwvu"), data("hello there")
    steps = 3
    la, lb, lc = [], [], []
    adam = types.AdamParams(learning_rate=2e-2)
    with tinker.ServiceClient() as s1:
        a = s1.create_lora_training_client(base_model=_base(), rank=4, seed=11).result()
        c = s1.create_lora_training_client(base_model=_base(), rank=8, seed=13).result()
        with tinker.ServiceClient() as s2:
            b = s2.create_lora_training_client(base_model=_base(), rank=4, seed=12).result()
            for step in range(steps):
                fa, fb = a.forward_backward(da, "cross_entropy"), b.forward_backward(
                    db, "cross_entropy")
                oa, ob = a.optim_step(adam), b.optim_step(adam)
                if step == 1:               # another rank: a cluster restart to and fro
                    lc += _train(c, dc, 1)
                la.append(fa.result().metrics["loss:sum"])
                lb.append(fb.result().metrics["loss:sum"])
                oa.result(), ob.result()
            freed = b.model_id

        async def gone() -> None:
            client = AsyncTinker(base_url=server)
            with pytest.raises(tinker.NotFoundError, match="was freed"):
                await client.models.get_info(request=types.GetInfoRequest(model_id=freed))
            await client.close()
        asyncio.run(gone())
        la += _train(a, da, 1)
    with tinker.ServiceClient() as alone:
        for (rank, seed), d, losses in (((4, 11), da, la), ((4, 12), db, lb), ((8, 13), dc, lc)):
            tc = alone.create_lora_training_client(base_model=_base(), rank=rank, seed=seed)
            np.testing.assert_allclose(_train(tc.result(), d, len(losses)), losses, rtol=1e-6)
    assert la[-1] < la[0] and lb[-1] < lb[0], (la, lb)


def test_live_models_are_bounded_and_closing_a_session_frees_them(server: str):
    """The `--max-models` bound (default 8): one client more is a BadRequestError naming the
    option; closing the session frees its models, and a new client trains."""
    seq = [3, 7, 9, 12, 5]
    with tinker.ServiceClient() as service:
        with pytest.raises(tinker.BadRequestError, match="at most 8 live.*--max-models"):
            for _ in range(9):
                service.create_lora_training_client(base_model=_base(), rank=4, seed=11).result()
    with tinker.ServiceClient() as service:
        tc = service.create_lora_training_client(base_model=_base(), rank=4, seed=11).result()
        assert _train(tc, [_datum(seq, weights=[1.0] * 4)], 1)[0] > 0
