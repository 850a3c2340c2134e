"""Request bodies of /v1/chat/completions and /v1/completions (unknown fields are refused).

Ranges follow OpenAI's where it has one; `top_k`, `min_p`, `repetition_penalty` and
`speculative` are this server's extensions, and so are `response_format` types `regex` and `grammar`
(and `response_format` on /v1/completions). `cache_salt` is vLLM's: requests share what the server remembers
across requests (the prefix cache, the `suffix` drafter's corpus) only with requests of the same salt.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Most samples one request may ask for, most stop strings and the longest one (in characters: each token's stop
# check looks back that far), and the longest `cache_salt`.
MAX_N = 16
MAX_STOPS = 4
MAX_STOP_LENGTH = 256
MAX_CACHE_SALT_LENGTH = 256


class Speculative(BaseModel):
    """Per-request speculation: who drafts (`none` = plain decoding) and how many tokens a step (or `auto`)."""

    model_config = ConfigDict(extra="forbid")
    drafter: Optional[StrictStr] = None
    k: Optional[Union[Annotated[StrictInt, Field(ge=1)], Literal["auto"]]] = None


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: a name and the schema (always followed: `strict` or not)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(BaseModel):
    """What the answer must match: `text` (anything), `json_object`, `json_schema` (OpenAI's), or this server's
    `regex` (the whole answer matches `regex`) and `grammar` (`grammar` in Lark or GBNF syntax)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: Optional[JsonSchemaFormat] = None
    regex: Optional[StrictStr] = None
    grammar: Optional[StrictStr] = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """What both endpoints take: budget, sampling, stopping, streaming, speculation."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    seed: Optional[StrictInt] = Field(None, ge=0, lt=2**63)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None  # accepted and ignored, as OpenAI only logs it
    speculative: Optional[Speculative] = None
    response_format: Optional[ResponseFormat] = None
    cache_salt: Optional[StrictStr] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_LENGTH)

    def stop_strings(self) -> list[str]:
        """The stop strings as a list (OpenAI allows one string or a list)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart]]
    name: Optional[StrictStr] = None

    def text(self) -> str:
        """The message's text (parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    logprobs: Optional[StrictInt] = None
    echo: Literal[False] = False
