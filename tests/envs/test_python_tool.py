"""The ``python`` environment: the code's output comes back as tokens; the sandbox has no
network, a time limit and a memory limit."""

from __future__ import annotations

import socket

import pytest

from reco_megatron.envs.python_tool import PythonEnv


class Chars:
    """A character-level tokenizer (the tiny SentencePiece model cannot write ``/``)."""

    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def env() -> PythonEnv:
    try:
        return PythonEnv(Chars())
    except RuntimeError as exc:  # a kernel without unprivileged namespaces: nothing to test
        pytest.skip(str(exc))


def _call(env: PythonEnv, code: str) -> str:
    tok = env.tokenizer
    step = env.step(tok.encode(f"Let me compute. <python>{code}</python>"), "stop")
    assert not step.done
    return tok.decode(step.observation_ids)


def test_the_output_comes_back_as_tokens(env) -> None:
    assert _call(env, "print(6 * 7)") == "<output>42\n</output>"
    assert "ZeroDivisionError" in _call(env, "1 / 0")
    assert env.step(env.tokenizer.encode("The answer is 42."), "stop").done
    assert env.step(env.tokenizer.encode("<python>print(1)</python>"), "length").done
    # the stop token inside something else: no call, the action goes on
    assert env.step(env.tokenizer.encode("a <b>"), "stop") == env.step([ord(">")], "stop")
    assert not env.step(env.tokenizer.encode("a <b>"), "stop").done


def test_the_sandbox_has_no_network(env) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        code = (
            "import socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('open')\n"
            "except OSError as e:\n    print('blocked', type(e).__name__)"
        )
        assert "blocked" in _call(env, code)
    finally:
        server.close()


def test_the_sandbox_limits_time_and_memory(env) -> None:
    assert _call(env, "while True: pass") == "<output>timeout</output>"
    assert "MemoryError" in _call(env, "x = bytearray(4 * 1024 ** 3)")
