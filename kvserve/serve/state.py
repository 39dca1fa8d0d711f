"""What every handler shares: the engine thread, the served name, the key, the limits."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.serve.engine_thread import EngineThread
from kvserve.serve.errors import APIError


@dataclass(slots=True)
class ServerState:
    engine: EngineThread
    served_name: str
    """The one model name clients use (`--served-model-name`, else the model as given)."""
    description: str
    """Which checkpoint runs (kvserve.default_model.ResolvedModel.description)."""
    api_key: str | None = None
    max_model_len: int | None = None

    def check_model(self, name: object) -> None:
        """A request may leave `model` out; naming another model is a 404, as OpenAI answers."""
        if name is None or name == self.served_name:
            return
        if not isinstance(name, str):
            raise APIError("model must be a string", param="model")
        raise APIError(
            f"the model {name!r} does not exist; this server serves {self.served_name!r}",
            404,
            param="model",
            code="model_not_found",
        )
