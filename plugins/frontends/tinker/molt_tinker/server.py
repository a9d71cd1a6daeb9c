"""The HTTP routes of `molt serve-tinker` (FastAPI on 127.0.0.1): Tinker's `/api/v1/...` as the
pinned SDK calls them, request bodies validated with the SDK's own types. Long requests answer a
future id at once; `retrieve_future` long-polls it (try_again after `poll_s`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from tinker import types

from molt_tinker import wire
from molt_tinker.service import HTTPError, Service

__all__ = ["add_args", "app", "main"]

PROTO = "application/x-protobuf"


def _result(out: tuple) -> Response:
    if out[0] == "proto":
        return Response(out[1], media_type=PROTO)
    return JSONResponse(out[1])


def app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        loop = asyncio.get_running_loop()
        await asyncio.wrap_future(service.train.submit(service.start, loop))
        yield
        await asyncio.to_thread(service.close)

    api = FastAPI(title="molt serve-tinker", lifespan=lifespan)
    v1 = "/api/v1"

    @api.exception_handler(HTTPError)
    async def _http(_: Request, e: HTTPError) -> JSONResponse:
        return JSONResponse({"detail": e.detail}, status_code=e.status)

    @api.exception_handler(ValidationError)
    async def _invalid(_: Request, e: ValidationError) -> JSONResponse:
        return JSONResponse({"detail": f"bad request body: {e}"}, status_code=400)

    async def body(request: Request, model: Any) -> Any:
        return model.model_validate(await request.json())

    def future(rid: str, **extra: Any) -> dict:
        return {"request_id": rid, **extra}

    @api.get(f"{v1}/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @api.get(f"{v1}/get_server_capabilities")
    async def capabilities() -> dict:
        return service.capabilities()

    @api.post(f"{v1}/client/config")
    async def client_config() -> dict:
        # httpx's own transport, futures polled one by one, custom losses run client-side
        return types.ClientConfigResponse(use_pyqwest_transport=False).model_dump()

    @api.post(f"{v1}/client/dynamic_config")
    async def dynamic_config() -> dict:
        return types.ClientDynamicConfigResponse().model_dump()

    @api.post(f"{v1}/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}      # the SDK's telemetry stays on this machine, unread

    @api.post(f"{v1}/create_session")
    async def create_session() -> dict:       # tags and metadata: not kept
        return {"type": "create_session", "session_id": service.create_session()}

    @api.post(f"{v1}/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        service.heartbeat((await body(request, types.SessionHeartbeatRequest)).session_id)
        return {"type": "session_heartbeat"}

    @api.post(v1 + "/sessions/{sid}/finish")
    async def finish(sid: str) -> dict:
        service.finish_session(sid)
        return {}

    @api.post(f"{v1}/create_model")
    async def create_model(request: Request) -> dict:
        r = await body(request, types.CreateModelRequest)
        lora = r.lora_config or types.LoraConfig(rank=32)
        if not (lora.train_mlp and lora.train_attn):
            raise HTTPError(400, "this server trains LoRA on every linear layer (train_mlp and "
                                 "train_attn True)")
        m = service.new_model(r.session_id, r.model_seq_id, r.base_model, lora.rank, lora.seed)
        # its first request builds it (`Service._use`)
        return future(service.submit(lambda: ("json", {"model_id": m.id, "type": "create_model"}),
                                     m), model_id=m.id)

    @api.post(f"{v1}/get_info")
    async def get_info(request: Request) -> dict:
        return service.info(service.get_model((await body(request, types.GetInfoRequest)).model_id))

    @api.post(f"{v1}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        if PROTO not in request.headers.get("content-type", ""):
            raise HTTPError(400, f"forward_backward takes a protobuf body ({PROTO})")
        from tinker.proto import tinker_public_pb2 as pb
        msg = pb.ForwardBackwardRequest()
        try:
            msg.ParseFromString(await request.body())
        except Exception as e:
            raise HTTPError(400, f"forward_backward body is not a ForwardBackwardRequest: {e}")
        m = service.get_model(msg.model_id)

        def run() -> tuple:
            config, datums = wire.decode_forward_backward(msg)
            return service.forward_backward(m, msg.loss_fn, config, datums, not msg.forward_only)
        return future(service.submit(run, m, msg.seq_id), model_id=m.id)

    @api.post(f"{v1}/optim_step")
    async def optim_step(request: Request) -> dict:
        r = await body(request, types.OptimStepRequest)
        m = service.get_model(r.model_id)
        if not isinstance(r.optim_params, types.AdamParams):
            raise HTTPError(400, f"optimizer '{r.optim_params.type}' is not served; AdamParams")
        adam = r.optim_params.model_dump()
        return future(service.submit(lambda: service.optim_step(m, adam), m, r.seq_id),
                      model_id=m.id)

    @api.post(f"{v1}/save_weights")
    async def save_weights(request: Request) -> dict:
        r = await body(request, types.SaveWeightsRequest)
        m = service.get_model(r.model_id)
        name = r.path or f"step-{m.step:06d}"
        return future(service.submit(lambda: service.save_weights(m, name, r.overwrite), m,
                                     r.seq_id), model_id=m.id)

    @api.post(f"{v1}/load_weights")
    async def load_weights(request: Request) -> dict:
        r = await body(request, types.LoadWeightsRequest)
        if r.model_id is not None:
            m, seq = service.get_model(r.model_id), r.seq_id
        else:           # create_training_client_from_state: a new model holding the checkpoint
            if r.path not in service.checkpoints:
                raise HTTPError(404, f"unknown checkpoint '{r.path}'")
            meta = service.checkpoint(r.path)[1]
            m = service.new_model(r.session_id, r.model_seq_id, r.base_model or meta["base_model"],
                                  meta["lora_rank"], None)
            m.next_seq, seq = 0, 0
        return future(service.submit(lambda: service.load_weights(m, r.path, r.optimizer), m,
                                     seq), model_id=m.id)

    @api.post(f"{v1}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        r = await body(request, types.SaveWeightsForSamplerRequest)
        m = service.get_model(r.model_id)
        return future(service.submit(lambda: service.save_for_sampler(m, r.path), m, r.seq_id),
                      model_id=m.id)

    @api.post(f"{v1}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        r = await body(request, types.CreateSamplingSessionRequest)
        service.session(r.session_id)
        base = service.base_name(r.base_model) if r.model_path is None else None
        return {"type": "create_sampling_session",
                "sampling_session_id": service.new_sampler(r.model_path, base)}

    @api.get(v1 + "/samplers/{sid}")
    async def sampler(sid: str) -> dict:
        if sid not in service.samplers:
            raise HTTPError(404, f"unknown sampling session '{sid}'")
        key, base = service.samplers[sid]
        return {"sampler_id": sid, "base_model": base,
                "model_path": None if key == "base" else key}

    @api.post(f"{v1}/asample")
    async def asample(request: Request) -> dict:
        r = await body(request, types.SampleRequest)
        if r.num_samples < 1:
            raise HTTPError(400, f"num_samples must be >= 1, got {r.num_samples}")
        rid = service.submit(lambda: service.sample(r), on_loop=True)
        return future(rid, sample_sequence_ids=[f"{rid}-{i}" for i in range(r.num_samples)])

    @api.post(f"{v1}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        r = await body(request, types.FutureRetrieveRequest)
        return _result(await service.retrieve(r.request_id))

    @api.post(f"{v1}/cancel_future")
    async def cancel_future() -> dict:
        return {}

    return api


def add_args(p: argparse.ArgumentParser) -> None:
    from molt_core.cli import recipe_args
    recipe_args(p, help="the recipe whose model (model.path), trainer and engine serve Tinker")
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000)")
    p.add_argument("--model-name", action="append", default=[], metavar="NAME",
                   help="another name clients may give as base_model (default: model.path)")
    p.add_argument("--session-timeout", type=float, default=300.0, metavar="S",
                   help="a session without a heartbeat for S seconds expires (default 300)")
    p.add_argument("--keep-samplers", type=int, default=4, metavar="N",
                   help="sampler weights kept in memory (the newest N; default 4)")
    p.add_argument("--max-models", type=int, default=8, metavar="N",
                   help="live training clients at most, time-sharing one trainer (default 8)")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from molt_core.cli import load
    cfg, plugins = load(args.recipe, args.overrides, args.plugin, args.blocked)
    names = [*args.model_name, cfg.model.path, str(Path(cfg.model.path).resolve())]
    service = Service(cfg, plugins, list(dict.fromkeys(names)),
                      session_timeout_s=args.session_timeout, keep_samplers=args.keep_samplers,
                      max_models=args.max_models)
    print(f"molt serve-tinker: http://127.0.0.1:{args.port} (TINKER_BASE_URL; any TINKER_API_KEY "
          f"starting tml-), base_model {service.names[0]!r}", file=sys.stderr)
    uvicorn.run(app(service), host="127.0.0.1", port=args.port, log_level="warning")
    return 0
