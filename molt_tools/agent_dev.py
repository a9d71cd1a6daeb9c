"""The agent developer's loop, without training: `molt serve RECIPE` and `molt rollout RECIPE -n N`.

`molt serve`: the recipe's engine (weights from `model.path`) behind the chat server, no trainer.
Prints the OpenAI and Anthropic base URLs and the api key; point any agent, SDK or framework at
them. Everything the policy generates is captured as one trajectory (a conversation that does not
extend the previous one starts a new segment), saved to `RUN_DIR/trajectories/` on Ctrl-C.

`molt rollout`: runs the recipe's agent N times exactly as training would (same agent, sampling,
rewards), saves the trajectories in the training format (`RUN_DIR/trajectories/step_000000.parquet`,
`molt_core.run.trajectory_store`), and prints each rollout's reward and its tokens (trainable tokens
highlighted).
"""

from __future__ import annotations

import copy
import dataclasses
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from molt_tools import demos

__all__ = ["rollout", "rollout_args", "serve", "serve_args", "token_view"]


def serve_args(p: Any) -> None:
    from molt_core.cli import recipe_args
    recipe_args(p)
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")


def rollout_args(p: Any) -> None:
    from molt_core.cli import recipe_args
    recipe_args(p)
    p.add_argument("-n", type=int, default=4, help="rollouts to run (default 4)")
    p.add_argument("--quiet", action="store_true", help="rewards only, no token view")
    demos.add_args(p)
    p.add_argument("--greedy", action="store_true",
                   help="greedy sampling, as held-out eval's greedy pass (not for training)")
    p.add_argument("--eval", action="store_true",
                   help="the held-out tasks of eval.agent_args, as held-out eval runs them")


def _setup(args: Any, suffix: str) -> tuple[Any, Any, Any, int, Path]:
    from transformers import AutoConfig

    from molt_core.cli import load
    from molt_core.config import to_dict
    from molt_core.multimodal import load_tokenizer
    from molt_core.run.metrics import make_run_dir

    cfg, plugins = load(args.recipe, args.overrides, args.plugin, args.blocked)
    tok = load_tokenizer(cfg.model.path, cfg.model.chat_template)
    vocab = AutoConfig.from_pretrained(cfg.model.path).get_text_config().vocab_size
    run_dir = make_run_dir(cfg.out_dir, f"{cfg.name}-{suffix}", to_dict(cfg), plugins.info,
                           cfg.seed, ["molt", *args.argv])
    return cfg, plugins, tok, vocab, run_dir


def _save(run_dir: Path, trajs: list, tok: Any, task_of: Callable[[int], int] | None) -> Path:
    from molt_core.run.trajectory_store import trajectory_rows, write_trajectories
    out = run_dir / "trajectories"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "step_000000.parquet"
    write_trajectories(path, trajectory_rows(0, trajs, tok, task_of=task_of,
                                             image_dir=out / "images"))
    return path


def token_view(traj: Any, tok: Any, color: bool) -> str:
    """The trajectory's text, trainable runs in green (or between ⟦ ⟧ without color)."""
    out, start = [], 0
    for i in range(1, len(traj) + 1):
        if i == len(traj) or traj.loss_mask[i] != traj.loss_mask[start] or i in traj.segments:
            text = tok.decode(traj.token_ids[start:i], skip_special_tokens=False)
            if traj.loss_mask[start]:
                text = f"\033[32m{text}\033[0m" if color else f"⟦{text}⟧"
            out.append(("\n--- segment ---\n" if start in traj.segments[1:] else "") + text)
            start = i
    return "".join(out)


def rollout(args: Any) -> int:
    from molt_core.run import cluster
    from molt_core.rollout.eval import EVAL_TASKS, GREEDY, eval_agent
    from molt_core.rollout.generator import Generator

    if args.n < 1:
        print("error: -n must be >= 1", file=sys.stderr)
        return 2
    try:
        more, extra = demos.configure(args)
        keep = demos.keep_filter(args.keep)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.overrides = [*args.overrides, *more]
    cfg, plugins, tok, vocab, run_dir = _setup(args, "rollout")
    cfg = copy.deepcopy(cfg)
    cfg.rollout.group_size = 1
    try:
        cfg.agent.args = demos.chat_args(cfg.agent.args, extra)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "greedy", False):      # after load: training refuses top_k (config_rules)
        cfg.sampling = dataclasses.replace(cfg.sampling, **GREEDY)
    held_out = getattr(args, "eval", False)
    agent = eval_agent(cfg, plugins, tok) if held_out else \
        plugins.get("agent", cfg.agent.name)(cfg, tok, plugins, **cfg.agent.args)
    with cluster.start(cfg, plugins, trainer=False) as (_, engines):
        gen = Generator(agent, engines, cfg, tok, vocab,
                        (lambda g: EVAL_TASKS + g) if held_out else None, held_out)
        try:
            trajs = [t for g in gen.generate(args.n) for t in g]
        finally:
            gen.close()
    path = _save(run_dir, trajs, tok, gen.task_of)
    color = sys.stdout.isatty()
    for i, t in enumerate(trajs):
        print(f"rollout {i}: task {gen.task_of(t.group_id)}, reward {t.reward:.3f}, "
              f"{len(t)} tokens ({t.num_trainable} trainable)"
              f"{', truncated' if t.truncated else ''}")
        if not args.quiet:
            print(token_view(t, tok, color) + "\n")
    rewards = [t.reward for t in trajs]
    print(f"mean reward {sum(rewards) / max(1, len(rewards)):.3f} over {len(trajs)} rollouts "
          f"({args.n - len(trajs)} dropped); saved {path}")
    print(demos.summary(trajs))
    kept = [t for t in trajs if keep(t)]
    if args.keep:
        print(f"kept {len(kept)} of {len(trajs)} ({args.keep})")
    if args.sft_out:
        print(f"wrote {demos.write_rows(args.sft_out, kept, tok)} SFT rows to {args.sft_out}")
    return 0


def serve(args: Any, ready: Callable[[dict], None] | None = None,
          stop: threading.Event | None = None) -> int:
    """Serve until Ctrl-C, SIGTERM (or `stop`); `ready` gets the URLs and key once serving."""
    from transformers import AutoConfig

    from molt_core.run import cluster
    from molt_core.chat.server import ChatServer
    from molt_core.rollout.generator import Generator

    cfg, plugins, tok, vocab, run_dir = _setup(args, "serve")
    max_context = AutoConfig.from_pretrained(cfg.model.path).get_text_config() \
        .max_position_embeddings
    stop = stop or threading.Event()
    main_thread = threading.current_thread() is threading.main_thread()
    with cluster.start(cfg, plugins, trainer=False) as (_, engines):
        # after Ray's start: its C++ handler would abort (exit 134) with a stack dump
        old = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if main_thread else None
        gen = Generator(None, engines, cfg, tok, vocab)
        server = ChatServer(port=args.port)
        try:
            gen.submit(server.start()).result(timeout=30)
            s = server.open_session(tok, gen._generate, gen.sampling, max_context=max_context)
            info = {"openai_base_url": s.base_url, "anthropic_base_url": s.anthropic_base_url,
                    "api_key": s.api_key, "run_dir": str(run_dir)}
            print(f"serving {cfg.model.path} (engine {cfg.engine.name}), Ctrl-C to stop\n"
                  f"  OpenAI base_url:    {s.base_url}\n"
                  f"  Anthropic base_url: {s.anthropic_base_url}\n"
                  f"  api_key:            {s.api_key}", flush=True)
            if ready:
                ready(info)
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            traj = server.close_session(s)
        finally:
            gen.submit(server.close()).result(timeout=10)
            gen.close()
            if main_thread:
                signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)
    if len(traj):
        print(f"saved {_save(run_dir, [traj], tok, None)}")
    return 0
