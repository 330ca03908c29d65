"""``POST /v1/mixtures``: several sources, each with its own options, as one dataset."""

from __future__ import annotations

from fastapi import APIRouter, Response

from preprocess_service.deps import SettingsDep, SubmitterDep, ViewsDep
from preprocess_service.mixtures import submit_mixture
from preprocess_service.routes.datasets import CREATED_RESPONSES, refuse_when_disk_full
from preprocess_service.schemas import DatasetStatus, MixtureRequest
from preprocess_service.views import created_answer

router = APIRouter(tags=["datasets"])


@router.post("/v1/mixtures", response_model=DatasetStatus, status_code=202, responses=CREATED_RESPONSES)
def create_mixture(body: MixtureRequest, response: Response, settings: SettingsDep, submitter: SubmitterDep,
                   views: ViewsDep) -> DatasetStatus:
    """Tokenize several sources, each with its own options, into one dataset that records each source and the
    mixing rule (weights, seed, sample_by); train from its id like any dataset. Content-addressed."""
    refuse_when_disk_full(settings)
    row, _created = submit_mixture(submitter, body)
    return created_answer(views.status(row), response)
