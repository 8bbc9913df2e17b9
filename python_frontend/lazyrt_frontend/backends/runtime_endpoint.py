"""RuntimeEndpoint: a program's backend over HTTP to `python -m lazyrt.launch`."""

from __future__ import annotations

import json

import httpx

from lazyrt_frontend.backends.base import ProgramPrompt, TextCallback


class BackendError(RuntimeError):
    pass


class RuntimeEndpoint:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # One pooled client: it is thread-safe, and run_batch's threads share its connections.
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def _post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json=body)
        if r.status_code != 200:
            raise BackendError(f"{path}: HTTP {r.status_code}: {_error_message(r)}")
        return r.json()

    @staticmethod
    def _program_body(prompt: ProgramPrompt) -> dict:
        return {
            "messages": prompt.messages,
            "docs": prompt.docs,
            "doc_turn": prompt.doc_turn,
            "continue_final": True,
        }

    def generate(self, prompt: ProgramPrompt, sampling: dict, on_text: TextCallback | None = None) -> dict:
        body = {**self._program_body(prompt), "sampling_params": sampling}
        if on_text is None:
            out = self._post("/generate", body)
            return {"text": out["text"], "meta": out["meta"], "logprobs": out.get("logprobs")}
        return self._stream({**body, "stream": True}, on_text)

    def _stream(self, body: dict, on_text: TextCallback) -> dict:
        text, meta, logprobs = "", {}, None
        with self.client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise BackendError(f"/generate: HTTP {r.status_code}: {_error_message(r)}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    raise BackendError(f"/generate: {event['error'].get('message')}")
                if event.get("text"):
                    text += event["text"]
                    on_text(event["text"])
                meta = event.get("meta") or meta
                if event.get("logprobs") is not None:
                    logprobs = (logprobs or []) + event["logprobs"]
        return {"text": text, "meta": meta, "logprobs": logprobs}

    def score(self, prompt: ProgramPrompt, continuations: list[str]) -> list[float]:
        body = {**self._program_body(prompt), "continuations": list(continuations)}
        return list(self._post("/score", body)["scores"])

    def rag(self, docs: list[str | dict], question: str, system: str | None, sampling: dict) -> dict:
        body = {"text": question, "docs": list(docs), "system": system, "sampling_params": sampling}
        out = self._post("/generate", body)
        return {"text": out["text"], "meta": out["meta"]}

    def add_document(
        self,
        text: str,
        id: str | None = None,  # noqa: A002
        metadata: dict | None = None,
        precompute: bool = False,
    ) -> str:
        body = {"text": text, "id": id, "metadata": metadata, "precompute": precompute}
        return self._post("/v1/documents", body)["id"]

    def cache_stats(self) -> dict:
        r = self.client.get("/cache_stats")
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        self.client.close()


def _error_message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:500]
