"""tests/support/verify_vllm.py's summary of a failed vLLM run, which the vLLM tests match refusals against: it keeps
the failed assertion's source line whether vLLM's worker prefixes it with "[rank0]:" once or twice (a worker
restarted after an earlier checkpoint's failure prints both; the MiniMax-M2 refusal in tests/test_vllm_families.py
was summarised without its assertion that way)."""

from support.verify_vllm import _error_summary


def _log(prefix: str) -> str:
    return "\n".join(
        f"{prefix}{line}"
        for line in (
            "Traceback (most recent call last):",
            '  File "/venv/vllm/model_executor/layers/fused_moe/router.py", line 7, in select',
            '    assert self.scoring_func == "softmax"',
            "AssertionError",
        )
    )


def test_the_failed_assertion_is_kept_under_one_or_two_rank_prefixes():
    for prefix in ("", "[rank0]: ", "[rank0]: [rank0]: "):
        summary = _error_summary("loading ...\n" + _log(prefix))
        assert 'assert self.scoring_func == "softmax"' in summary, (prefix, summary)
        assert "AssertionError" in summary
        assert "File " not in summary  # traceback locations are left out
