"""Liveness: ``GET /healthz`` answers without authentication and shows no data."""

from fastapi import APIRouter

router = APIRouter()


@router.get("/healthz", include_in_schema=False)
def healthz() -> dict[str, str]:
    return {"status": "ok"}
