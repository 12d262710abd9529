"""What schemathesis runs against this server beyond its own checks, for `st run` and for
tests/test_server_contract.py alike: positive_data_acceptance (every schema-valid request is accepted), less the
refusals of a schema-valid request that no JSON schema can state. Run it with

    SCHEMATHESIS_HOOKS=schemathesis_hooks PYTHONPATH=tests st run http://127.0.0.1:PORT/openapi.json \\
        --seed 777 -c all --exclude-checks positive_data_acceptance --max-time 200 --request-timeout 120 \\
        --max-response-time 120

(docs/robustness.md, "The contract"): a schema-valid request is refused only for these reasons. The time limits
are for the longest answer, 2,048 embedding inputs in one request, on two busy cores (some 25 s)."""

from __future__ import annotations

import re
from typing import Any

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

# Refusals of a schema-valid request that depend on the model a request reaches or on the server's settings,
# or on a language of their own (the document says so in words): what accepts_stated_data lets through, and
# nothing else.
UNSTATABLE = {
    "vocabulary": r"outside the vocabulary \(0\.\.\d+\)",                   # token ids past the model's vocabulary
    "context": r"context (of|holds) \d+|do not fit (in )?the context",        # longer than the model's context
    "fill-in-the-middle": r"has no fill-in-the-middle tokens",                # /infill on a model without them
    "dimensions": r"embeddings have \d+ dimensions",                         # only the model's own size
    "slots": r"each choice needs a slot|n = \d+ .*slots",                     # n past the server's --slots
    # relations between values: a named tool_choice names one of the tools; no two tools share a name
    "tools": r"which is not among the tools|is defined twice",
    # a grammar, regular expression or JSON schema that does not compile, or can never be satisfied
    "constraint": r"^(grammar|regex|json_schema|response_format\.json_schema\.schema|format)\b",
    # /api/create: a Modelfile's own language, a name some model has already, a FROM path that is no model
    "preset": r"^modelfile: |is the name of a model already|neither a model file nor a checkpoint directory",
}


def reason(response: Any) -> str:
    """An error response's message, in either API's shape."""
    body = response.json()
    return body["error"]["message"] if isinstance(body.get("error"), dict) else str(body.get("error"))


@schemathesis.check
def accepts_stated_data(ctx: Any, response: Any, case: Any) -> bool | None:
    """positive_data_acceptance, but for a 400 whose reason is one of UNSTATABLE's."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if response.status_code == 400 and any(re.search(r, reason(response)) for r in UNSTATABLE.values()):
            return None
        raise
