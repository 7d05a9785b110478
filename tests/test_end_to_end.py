"""End to end on the embedded default: the real all-MiniLM-L6-v2 model behind local_tei,
the ingest flow under Prefect, local-mode Qdrant, then questions whose answers are known."""

from __future__ import annotations

from pathlib import Path

import pytest

from quarry.config import get_settings
from tests.conftest import write_corpus

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("prefect_harness")]

CORPUS = {
    "volcanoes.md": (
        "# Volcanoes\n\nA volcano erupts when molten magma from the mantle rises through "
        "cracks in the crust. Lava flows, ash clouds and pyroclastic flows follow.\n\n"
        "## Famous eruptions\n\nMount Vesuvius buried Pompeii in 79 AD under ash."
    ),
    "baking.md": (
        "# Sourdough\n\nSourdough bread rises because wild yeast and lactic acid bacteria in "
        "the starter ferment the flour and release carbon dioxide. Feed the starter with "
        "flour and water daily.\n\n## Baking\n\nBake the loaf in a hot Dutch oven."
    ),
    "chess.md": (
        "# Chess openings\n\nThe Sicilian Defence begins 1.e4 c5 and is Black's most popular "
        "reply to the king's pawn. The Queen's Gambit starts 1.d4 d5 2.c4."
    ),
    "orbits.md": (
        "# Planetary orbits\n\nPlanets move around the Sun in elliptical orbits, as Kepler's "
        "first law states. The Sun's gravity keeps them in their paths."
    ),
    "tax/filing.txt": (
        "Filing an income tax return: gather your wage statements, report all income, claim "
        "deductions, and submit the return before the deadline to avoid penalties."
    ),
}

QUESTIONS = {
    "Why does sourdough bread rise?": "kb/baking.md",
    "What causes a volcano to erupt?": "kb/volcanoes.md",
    "How do planets move around the sun?": "kb/orbits.md",
    "What is the Sicilian Defence in chess?": "kb/chess.md",
    "How do I file my income taxes?": "kb/tax/filing.txt",
}


def test_answers_rank_first_and_rerun_embeds_nothing(tmp_path: Path) -> None:
    from flows.ingest import ingest_flow
    from quarry.search import Searcher
    from quarry.services import open_services

    corpus = write_corpus(tmp_path / "kb", CORPUS)
    first = ingest_flow(sources=[str(corpus)], collection="e2e")
    assert first["documents_embedded"] == len(CORPUS)
    assert first["documents_failed"] == 0

    settings = get_settings(collection="e2e")
    with open_services(settings, quiet=True) as services:
        before = services.store.count()
        searcher = Searcher(services.store, services.embedder, services.reranker, threshold=0.0)
        for question, expected in QUESTIONS.items():
            response = searcher.search(question, top_k=3)
            assert response.reranked
            assert response.results[0].uri == expected, (question, response.results)
            assert response.model["model_id"] == "sentence-transformers/all-MiniLM-L6-v2"

    second = ingest_flow(sources=[str(corpus)], collection="e2e")
    assert second["documents_embedded"] == 0
    assert second["documents_skipped"] == len(CORPUS)
    assert second["embedding_requests"] == 0  # nothing to embed, not even the canary
    with open_services(settings, quiet=True) as services:
        assert services.store.count() == before
