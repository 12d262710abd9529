"""The chat page at / : one HTML page with its script and style, served from the package (no build step,
nothing fetched from elsewhere). A strict Content-Security-Policy keeps it to its own files and its own
origin's API, so even a rendering bug could not run injected script or send the conversation elsewhere."""

from __future__ import annotations

from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
         "chat.css": "text/css; charset=utf-8"}
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files("barellm.serve").joinpath("static", name).read_bytes()


async def page(request: Request) -> Response:
    return Response(_read("index.html"), media_type=FILES["index.html"], headers=HEADERS)


async def static(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES or name == "index.html":
        raise HTTPException(404)
    return Response(_read(name), media_type=FILES[name], headers=HEADERS)


def routes() -> list[Route]:
    return [Route("/", page, methods=["GET"]), Route("/static/{name}", static, methods=["GET"])]
