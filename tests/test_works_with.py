"""The documentation's "Works with" table (docs/integrations.md) is what the client tests recorded
(`python tests/works_with.py` rewrites both)."""

import json

from hf_attn_zoo.models import VARIANTS

import works_with
from conftest import CONFORMANCE

RESULTS = json.loads(works_with.RESULTS.read_text())


def test_the_page_table_is_rendered_from_the_recorded_results():
    assert works_with.page_table(works_with.PAGE.read_text()) == works_with.render(RESULTS), (
        "docs/integrations.md's table is not the recorded results; run `python tests/works_with.py --render`"
    )


# (client, variant) cells where the real client runs and answers otherwise, for a reason outside the zoo that the
# client's test states (and xfails strictly, so the cell changes when the client is fixed)
KNOWN_FAILURES: set[tuple[str, str]] = set()  # none today: vLLM's DeepseekV3 on the MLA export is refused up front

# (client, variant) cells no run has recorded yet, each with why: the table says "not tested" there
NOT_TESTED: dict[tuple[str, str], str] = {}


def test_every_client_has_an_answer_for_every_variant():
    """Every cell is "works" or an up-front refusal with its reason (or one of the known failures, with its reason);
    the MHA family and sliding window work with every client."""
    assert set(RESULTS) == set(works_with.CLIENTS)
    for client, outcomes in RESULTS.items():
        untested = {name for (where, name) in NOT_TESTED if where == client}
        assert set(outcomes) | untested == {name for name in VARIANTS if name in CONFORMANCE}, client
        assert not untested & set(outcomes), (client, "recorded now: remove it from NOT_TESTED")
        for name, outcome in outcomes.items():
            if (client, name) in KNOWN_FAILURES and outcome.startswith("fails: "):
                continue
            assert outcome == "works" or outcome.startswith("refused: ") and len(outcome) > 20, (client, name)
            if VARIANTS[name].family in ("mha", "sliding_window"):
                assert outcome == "works", (client, name, outcome)
