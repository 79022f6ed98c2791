"""Dashboard pages and htmx fragments (filled in by the web domain)."""

from fastapi import APIRouter

router = APIRouter(include_in_schema=False)
