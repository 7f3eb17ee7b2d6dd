"""`gemma4 template --jsonl` (the binary GEMMA4_BIN names) for the template differential tests."""

import json
import os
import subprocess

import pytest


def render_with_gemma4(template, requests):
    """One response object per request, rendered with the template file `template`."""
    binary = os.environ.get("GEMMA4_BIN")
    if not binary:
        pytest.skip("GEMMA4_BIN is not set")
    done = subprocess.run([binary, "template", "--template", str(template), "--jsonl"],
                          input="".join(json.dumps(r) + "\n" for r in requests), text=True,
                          capture_output=True, check=False)
    # split on "\n" only: prompts may hold U+2028/U+2029, which str.splitlines() also breaks at
    responses = [json.loads(line) for line in done.stdout.split("\n") if line]
    assert len(responses) == len(requests), done.stderr
    return responses
