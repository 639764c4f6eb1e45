"""The LLM judge: the score parser on malformed verdicts, the HTTP judge against a local server (timeouts, retries,
garbage), the cache, and a local-model judge on the embedded tiny model."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.config.schema import GRPOConfig
from posttrain.envs.judge import DEFAULT_SCORE_PATTERN, JudgeEnvironment, parse_score
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.config.environments import JudgeOptions
from posttrain.envs.registry import EnvironmentOptionError, build_environment


def judge_env(**options) -> JudgeEnvironment:
    """A judge environment built from its typed options, as the registry builds it for a recipe."""
    return build_environment(JudgeOptions(**options))


def logs(*pairs: tuple[str, str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}] for prompt, reply in pairs]


# ---- the parser ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, score", [
    ("Score: 7", 7.0),
    ("The answer is right.\n**Score:** 8/10", 8.0),
    ("score = 3.5.", 3.5),
    ("Score: 7. To be clear, final score: 7", 7.0),  # the same number twice is one score
    ("SCORE:10", 10.0),
])
def test_parse_score_reads_one_score(text, score):
    verdict = parse_score(text, DEFAULT_SCORE_PATTERN, 1.0, 10.0)
    assert (verdict.score, verdict.failure, verdict.error) == (score, None, None)


@pytest.mark.parametrize("text, failure", [
    ("", "no_score"),
    ("A fine answer, I would rate it highly.", "no_score"),
    ("underscore: 5", "no_score"),  # 'score' must be a word of its own
    ("Score: 3\nOn reflection, Score: 9", "several_scores"),
    ("Score: 11", "out_of_range"),
    ("Score: 0", "out_of_range"),
    ("Score: -2", "out_of_range"),
    ("Score: seven", "not_a_number"),
    ("Score: excellent", "not_a_number"),
    ("Score: nan", "not_a_number"),
    ("Score: inf", "not_a_number"),
])
def test_parse_score_failures_are_named(text, failure):
    verdict = parse_score(text, DEFAULT_SCORE_PATTERN, 1.0, 10.0)
    assert verdict.score is None and verdict.failure == failure
    assert repr(text) in verdict.error  # the judge's reply is quoted


def test_a_custom_pattern_and_its_checks():
    assert parse_score("Rating: [[4]]", r"\[\[(\d+)\]\]", 1, 5).score == 4.0
    assert parse_score("Rating: [[4]] and [[5]]", r"\[\[(\d+)\]\]", 1, 5).failure == "several_scores"
    with pytest.raises(ValueError, match="exactly one capture group"):
        JudgeEnvironment(base_url="http://127.0.0.1:1", model="m", score_pattern=r"\d+")
    with pytest.raises(ValueError, match="not a regular expression"):
        JudgeEnvironment(base_url="http://127.0.0.1:1", model="m", score_pattern=r"(\d+")


# ---- a judge server --------------------------------------------------------------------------------------------


class JudgeServer:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 (port 0). Each request takes the next action of
    `script`, then `default`: ("reply", text), ("reply_fn", f(body) -> text), ("sleep", s) then a reply,
    ("status", code) or ("raw", bytes)."""

    def __init__(self):
        self.script: list[tuple] = []
        self.default: tuple = ("reply", "Score: 7")
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "body": body,
                                        "authorization": self.headers.get("Authorization")})
                kind, value = server.script.pop(0) if server.script else server.default
                if kind == "sleep":
                    time.sleep(value)
                    kind, value = "reply", "Score: 5"
                if kind == "redirect":
                    self.send_response(value[0])
                    self.send_header("Location", value[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif kind == "drip":  # headers, then one byte of the body every `value` seconds
                    answer = json.dumps({"choices": [{"message": {"content": "Score: 5"}}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    for byte in answer:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(value)
                elif kind == "big":  # `value` bytes of a valid answer, without a Content-Length
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(b'{"choices": [{"message": {"content": "Score: 5 ' + b"x" * value + b'"}}]}')
                    self.close_connection = True
                elif kind == "status":
                    self._send(value, b"upstream failure")
                elif kind == "raw":
                    self._send(200, value)
                else:
                    text = value(body) if kind == "reply_fn" else value
                    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
                    self._send(200, json.dumps(answer).encode())

            def _send(self, status: int, payload: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a client that timed out closed the socket
                pass

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def http_judge(server: JudgeServer, **options) -> JudgeEnvironment:
    return judge_env(**{"base_url": server.url, "model": "judge-1", "retry_backoff_s": 0.01,
                              **options})


def test_http_judge_scores_and_sends_a_chat_completion(server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "secret-123")
    judge = http_judge(server, api_key_env="JUDGE_KEY", system_prompt="You grade answers.",
                       template="Q: {prompt}\nA: {response}\nGold: {answer}\nRange {min_score}-{max_score}.")
    step = judge.step(logs(("2+2=", "4")), [{"answer": "4"}])
    assert step.rewards == [pytest.approx((7 - 1) / 9)] and step.errors == [None] and step.done == [True]
    assert step.metadata == [{"answer": "4", "judge_score": 7.0}]
    (request,) = server.requests
    assert request["path"] == "/v1/chat/completions" and request["authorization"] == "Bearer secret-123"
    body = request["body"]
    assert body["model"] == "judge-1" and body["temperature"] == 0.0 and body["max_tokens"] == 64
    assert body["messages"] == [{"role": "system", "content": "You grade answers."},
                                {"role": "user", "content": "Q: 2+2=\nA: 4\nGold: 4\nRange 1-10."}]
    # A base_url that already ends in /v1 is not given a second one; normalize=false gives the raw score.
    raw = judge_env(**{"base_url": server.url + "/v1/", "model": "judge-1",
                             "normalize": False})
    assert raw.step(logs(("q", "r")), [{}]).rewards == [7.0]
    assert server.requests[-1]["path"] == "/v1/chat/completions"


def test_a_slow_judge_times_out_and_masks_the_sample(server):
    server.script = [("sleep", 2.0)]
    judge = http_judge(server, timeout_s=0.3, max_retries=0)
    started = time.monotonic()
    step = judge.step(logs(("q", "slow")), [{}])
    assert time.monotonic() - started < 1.5
    assert step.rewards == [None] and "timeout" in step.errors[0] and "timeout_s=0.3" in step.errors[0]
    assert judge.counts["timeout"] == 1
    # A timeout is not cached: the same pair is asked again and now succeeds.
    assert judge.step(logs(("q", "slow")), [{}]).rewards == [pytest.approx(6 / 9)]


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_and_the_key_never_reaches_another_origin(server, monkeypatch, status):
    # Issue 34 row 1: a 302 to another port was followed as a GET carrying the Authorization header, and that
    # server's answer was scored as a verdict.
    monkeypatch.setenv("JUDGE_KEY", "secret-123")
    other = JudgeServer()
    try:
        server.default = ("redirect", (status, other.url + "/v1/chat/completions"))
        judge = http_judge(server, api_key_env="JUDGE_KEY", max_retries=2)
        step = judge.step(logs(("q", "r")), [{}])
        assert other.requests == []  # nothing went to the other origin, key or not
        assert step.rewards == [None] and "redirects are not followed" in step.errors[0]
        assert other.url in step.errors[0] and len(server.requests) == 1  # final, not retried
        assert judge.counts["http_error"] == 1
    finally:
        other.close()


def test_the_deadline_covers_the_whole_call_not_each_read(server):
    # Issue 34 row 4: a server sending one byte every 0.5 s kept the call (and the run) waiting forever, as
    # timeout_s limited each read only.
    server.script = [("drip", 0.2)]
    judge = http_judge(server, timeout_s=1.0, max_retries=0)
    started = time.monotonic()
    step = judge.step(logs(("q", "r")), [{}])
    assert time.monotonic() - started < 2.5
    assert step.rewards == [None] and "timeout" in step.errors[0] and "timeout_s=1" in step.errors[0]


def test_an_answer_past_the_size_cap_is_not_read(server):
    # Issue 34 row 5: a 1.5 GB answer was read whole. Here 2 MB against a cap of 100 kB, with and without a
    # Content-Length; a small answer still passes.
    server.script = [("big", 2_000_000), ("raw", b"x" * 200_000)]
    judge = http_judge(server, max_response_bytes=100_000, max_retries=3)
    first = judge.step(logs(("q", "r")), [{}])
    second = judge.step(logs(("q", "s")), [{}])
    for step in (first, second):
        assert step.rewards == [None] and "max_response_bytes=100000" in step.errors[0]
    assert "200000 bytes" in second.errors[0] and len(server.requests) == 2  # final, not retried
    assert judge.step(logs(("q", "t")), [{}]).rewards == [pytest.approx(6 / 9)]


def test_http_500_is_retried_and_then_succeeds(server):
    server.script = [("status", 500)]
    judge = http_judge(server, max_retries=2)
    step = judge.step(logs(("q", "r")), [{}])
    assert step.rewards == [pytest.approx(6 / 9)] and step.errors == [None]
    assert len(server.requests) == 2 and not judge.counts["http_error"]


def test_http_500_forever_masks_the_sample_after_the_retries(server):
    server.default = ("status", 500)
    judge = http_judge(server, max_retries=2)
    step = judge.step(logs(("q", "r"), ("q", "other")), [{}, {}])
    assert step.rewards == [None, None]
    assert all("HTTP 500" in e and "after 3 attempts" in e for e in step.errors)
    assert len(server.requests) == 6 and judge.counts["http_error"] == 2
    # A client error is final: no retry.
    server.default = ("status", 400)
    assert judge.step(logs(("q", "x")), [{}]).rewards == [None]
    assert len(server.requests) == 7


@pytest.mark.parametrize("payload", [b"not json{", b'{"choices": []}', b'{"choices": [{"message": {"content": null}}]}',
                                     b"[1, 2]"])
def test_garbage_from_the_server_masks_the_sample(server, payload):
    server.script = [("raw", payload)]
    judge = http_judge(server)
    step = judge.step(logs(("q", "r")), [{}])
    assert step.rewards == [None] and "invalid_response" in step.errors[0]
    assert judge.counts["invalid_response"] == 1 and len(server.requests) == 1  # not retried


def test_an_unparsable_verdict_masks_and_counts(server):
    server.default = ("reply_fn", lambda body: "Score: 12" if "high" in body["messages"][-1]["content"] else "meh")
    judge = http_judge(server)
    step = judge.step(logs(("q", "high"), ("q", "low")), [{}, {}])
    assert step.rewards == [None, None]
    assert step.errors[0].startswith("judge (out_of_range)") and step.errors[1].startswith("judge (no_score)")
    assert judge.counts["out_of_range"] == 1 and judge.counts["no_score"] == 1


def test_identical_pairs_are_judged_once(server):
    server.default = ("reply_fn", lambda body: f"Score: {len(body['messages'][-1]['content']) % 9 + 1}")
    judge = http_judge(server)
    first = judge.step(logs(("q", "a"), ("q", "a"), ("q", "bb")), [{}, {}, {}])
    assert len(server.requests) == 2 and judge.counts["cache_hits"] == 1  # the duplicate within the batch
    second = judge.step(logs(("q", "bb"), ("q", "a")), [{}, {}])
    assert len(server.requests) == 2 and judge.counts["cache_hits"] == 3  # both answered from the cache
    assert second.rewards == [first.rewards[2], first.rewards[0]] and first.rewards[0] != first.rewards[2]
    assert judge.counts["judged"] == 2
    # A different column the template reads is a different question.
    judge_with_answer = http_judge(server, template="{prompt} {response} {answer}")
    judge_with_answer.step(logs(("q", "a"), ("q", "a")), [{"answer": "1"}, {"answer": "2"}])
    assert len(server.requests) == 4


def test_unreachable_server_is_a_connection_error(server):
    url = server.url
    server.close()
    judge = judge_env(**{"base_url": url, "model": "m", "max_retries": 1,
                               "retry_backoff_s": 0.0, "timeout_s": 2.0})
    step = judge.step(logs(("q", "r")), [{}])
    assert step.rewards == [None] and "connection_error" in step.errors[0] and "after 2 attempts" in step.errors[0]


def test_setup_errors_are_clear():
    with pytest.raises(ValueError, match="exactly one of them"):
        judge_env()
    with pytest.raises(ValueError, match="exactly one of them"):
        judge_env(**{"path": "x", "base_url": "http://127.0.0.1:1"})
    with pytest.raises(ValueError, match="needs model"):
        judge_env(**{"base_url": "http://127.0.0.1:1"})
    with pytest.raises(ValueError, match="judge environment scores with a model the caller builds"):
        judge_env(path="x")  # an environment never loads a model itself
    with pytest.raises(EnvironmentOptionError, match="NO_SUCH_JUDGE_KEY"):
        judge_env(**{"base_url": "http://127.0.0.1:1", "model": "m",
                           "api_key_env": "NO_SUCH_JUDGE_KEY"})
    with pytest.raises(EnvironmentOptionError, match="min_score"):
        judge_env(**{"base_url": "http://127.0.0.1:1", "model": "m", "min_score": 5.0,
                           "max_score": 5.0})
    with pytest.raises(EnvironmentOptionError, match="positional placeholder"):
        judge_env(**{"base_url": "http://127.0.0.1:1", "model": "m", "template": "{} {0}"})
    judge = judge_env(**{"base_url": "http://127.0.0.1:1", "model": "m",
                               "template": "{prompt} {response} {reference}"})
    with pytest.raises(ValueError, match=r"\{reference\}.*row 0"):
        judge.step(logs(("q", "r")), [{"answer": "1"}])


def test_judge_options_are_checked_when_the_config_loads():
    base = ["data.train_files=[x]", "environment.kind=judge"]
    cfg = load_config(GRPOConfig, None, [*base, "environment.options={base_url: 'http://127.0.0.1:8000', model: m, "
                                                "timeout_s: 5, max_retries: 1}"])
    assert cfg.environment.options.base_url == "http://127.0.0.1:8000"
    with pytest.raises(ConfigError, match="options.timeout: the judge environment has no option 'timeout'"):
        load_config(GRPOConfig, None, [*base, "environment.options={base_url: x, model: m, timeout: 5}"])
    with pytest.raises(ConfigError, match="options.max_retries: the judge environment expects int"):
        load_config(GRPOConfig, None, [*base, "environment.options={base_url: x, model: m, max_retries: true}"])


# ---- a local judge ---------------------------------------------------------------------------------------------


def test_local_model_judge_on_the_tiny_model_masks_and_counts_its_garbage(tiny_model_dir):
    # The embedded tiny model has learned nothing: its verdicts hold no score. Every sample is masked with the
    # reason, and counted; none becomes a zero.
    judge = build_recipe_environment({"kind": "judge", "options": {"path": str(tiny_model_dir), "max_new_tokens": 6,
                                                                   "batch_size": 2}})
    replies = logs(("1+1=", "2"), ("1+1=", "3"), ("2+2=", "4"), ("1+1=", "2"))
    step = judge.step(replies, [{}] * 4)
    assert step.rewards == [None] * 4 and all(e.startswith("judge (") for e in step.errors)
    failures = sum(judge.counts[k] for k in ("no_score", "not_a_number", "several_scores", "out_of_range"))
    assert failures == 4 and judge.counts["judged"] == 3 and judge.counts["cache_hits"] == 1
    assert [m["judge_score"] for m in step.metadata] == [None] * 4
    judge.close()


# ---- the embedded arithmetic judge's data and preset ------------------------------------------------------------


def test_arithmetic_judge_rows_pair_each_problem_with_a_right_and_a_wrong_reply():
    from posttrain.data.embedded import iter_embedded
    from posttrain.envs.arithmetic import JUDGE_TEMPLATE, all_problems

    rows = [row for _, row in iter_embedded("posttrain/arithmetic-judge:heldout[:400]")]
    assert len(rows) == 400
    for right, wrong in zip(rows[::2], rows[1::2]):
        a, b = (int(n) for n in right["prompt"].split("=")[0].split("+"))
        total = str(a + b)
        assert right == {"prompt": f"{a}+{b}={total}?", "completion": f"{total} vs {total}. Score: 1"}
        reply = wrong["prompt"].removeprefix(f"{a}+{b}=").removesuffix("?")
        assert reply.isdigit() and reply != total
        assert wrong["completion"] == f"{total} vs {reply}. Score: 0"
        assert right["prompt"] == JUDGE_TEMPLATE.format(prompt=f"{a}+{b}=", response=total)
    # The splits are the arithmetic task's: no held-out problem is in the judge's training rows.
    heldout = {p.prompt for p in all_problems("heldout")}
    train_prompts = {row["prompt"].split("=")[0] + "=" for _, row in iter_embedded("posttrain/arithmetic-judge:train")}
    assert train_prompts and not train_prompts & heldout
    # Some wrong replies are plausible wrong sums (near the answer), some any number.
    wrong_replies = [(int(w["prompt"].split("=")[1][:-1]), int(w["completion"].split(" ")[0])) for w in rows[1::2]]
    near = sum(abs(reply - total) in (1, 10) for reply, total in wrong_replies)
    assert 0.4 * len(wrong_replies) < near < 0.95 * len(wrong_replies)
    appended = sum(str(reply)[:-1] == str(total) for reply, total in wrong_replies)  # the sum with a digit after it
    assert 0.05 * len(wrong_replies) < appended < 0.3 * len(wrong_replies)


def test_the_judge_preset_asks_what_the_judge_learned_and_reads_its_verdicts():
    from posttrain.envs.arithmetic import JUDGE_TEMPLATE, Problem, judge_verdict

    cfg = load_config(GRPOConfig, "configs/grpo_judge_arithmetic.yaml")
    judge = next(c for c in cfg.environment.options.components if c.kind == "judge")
    assert judge.options.template == JUDGE_TEMPLATE
    assert judge.options.path == "posttrain/tiny-arithmetic-judge"
    options = judge.options
    for reply, score in (("46", 1.0), ("47", 0.0), ("", 0.0)):
        verdict = parse_score(judge_verdict(Problem(12, 34), reply), DEFAULT_SCORE_PATTERN, options.min_score,
                              options.max_score)
        assert (verdict.score, verdict.failure) == (score, None)


def test_the_api_key_is_written_to_no_file_of_the_run(server, monkeypatch, tmp_path, tiny_model_dir):
    # Issue 34: the key is read from the environment variable api_key_env names; config.yaml, metrics, samples,
    # run_info and the report hold at most that name. The judge gets the key (its requests carry it).
    from rl_configs import TINY_RL

    from posttrain.algorithms.grpo import train_grpo

    monkeypatch.setenv("JUDGE_KEY", "sk-secret-5e1f")
    out = tmp_path / "run"
    cfg = load_config(GRPOConfig, None, [*TINY_RL, "trainer.max_steps=1", "rollout.prompts_per_step=2",
                                         f"output_dir={out}", "environment.kind=judge",
                                         f"environment.options={{base_url: '{server.url}', model: j, "
                                         "api_key_env: JUDGE_KEY, retry_backoff_s: 0.01}"])
    train_grpo(cfg)
    assert server.requests and all(r["authorization"] == "Bearer sk-secret-5e1f" for r in server.requests)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files) and any(p.name == "report.html" for p in files)
    assert not [p for p in files if b"sk-secret-5e1f" in p.read_bytes()]
