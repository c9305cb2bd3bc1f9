"""The request and response bodies, as OpenAI's API reference lays them out (pydantic models; the
app's OpenAPI document is generated from them, and schemathesis fuzzes the server against it).

Extensions beyond OpenAI's spec are named in their descriptions: top_k, repetition_penalty,
top_p_mode, and transformers' warpers and constraints under vLLM's names where vLLM has the field
(min_p, min_tokens, bad_words), transformers' otherwise (typical_p, epsilon_cutoff, eta_cutoff,
no_repeat_ngram_size, suppress_tokens); beam search under vLLM's names (use_beam_search,
length_penalty, early_stopping; a choice's score) and contrastive search under transformers'
(penalty_alpha) — on completions and chat alike (`Extensions`; chat also takes best_of); the
`pieces` of /tokenize and /detokenize.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpt2kit.sampling import bad_words_ids
from gpt2kit.validate import SettingError

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
Stop = str | Annotated[list[str], Field(max_length=4)] | None
MAX_BAD_WORDS, MAX_SUPPRESS = 256, 4096  # entries of bad_words and suppress_tokens in one request
MAX_INTERVENTIONS, MAX_SPEC = 64, 256  # interventions[] entries and characters (the server's own bound is lower)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = Field(None, description="send a last chunk with usage and no choices")


class _SamplingRequest(BaseModel):
    """What completions and chat requests share: the model, the sampling settings, streaming."""

    model_config = _STRICT
    model: str
    temperature: float | None = Field(1.0, ge=0, le=2, description="0 (or below 1e-5) = greedy")
    top_p: float | None = Field(1.0, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=128)
    stream: bool | None = False
    stop: Stop = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    user: str | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema (default: any JSON)")
    strict: bool | None = Field(None, description="the output always follows the schema, strict or not")


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    model_config = _STRICT
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = Field(None, min_length=1)
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, min_length=1, description="a Lark or GBNF grammar")
    json_object: bool | None = None


class Extensions(BaseModel):
    """The extensions completions and chat requests share (transformers' warpers and constraints,
    beam search, contrastive search), with the same bounds and the same 400s on both endpoints."""

    model_config = _STRICT
    top_k: int | None = Field(None, ge=0, description="extension: keep the k most likely tokens (0 = off)")
    repetition_penalty: float | None = Field(None, ge=0.01, le=100,
                                             description="extension: CTRL's penalty (1 = off)")
    top_p_mode: Literal["openai", "hf"] | None = Field(
        None, description="extension: openai keeps tokens with cumulative prob <= top_p; hf also the one crossing it")
    min_p: float | None = Field(None, ge=0, le=1, description="extension (vLLM's): drop tokens less likely than "
                                                             "min_p x the top token (0 = off)")
    typical_p: float | None = Field(None, gt=0, le=1,
                                    description="extension: locally typical sampling's mass (1 = off)")
    epsilon_cutoff: float | None = Field(None, ge=0, lt=1, description="extension: epsilon sampling (0 = off)")
    eta_cutoff: float | None = Field(None, ge=0, lt=1, description="extension: eta sampling (0 = off)")
    no_repeat_ngram_size: int | None = Field(None, ge=0, description="extension: never repeat an n-gram of this "
                                                                      "size, the prompt's included (0 = off)")
    bad_words: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="extension (vLLM's): words never generated, each tokenized with and without a leading space")
    min_tokens: int | None = Field(None, ge=0, description="extension (vLLM's): no stop before this many tokens")
    ignore_eos: bool | None = Field(None, description="extension (vLLM's): <|endoftext|> does not end the row; "
                                                      "generation goes on to max_tokens or a stop string")
    suppress_tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_SUPPRESS)] | None = Field(
        None, description="extension: token ids never generated")
    # extensions: beam search (vLLM's names; serve/search.py) and contrastive search (transformers')
    use_beam_search: bool | None = Field(
        None, description="extension (vLLM's): beam search with best_of beams per prompt (default n; at most 64 and "
                          "the server's --max-batch); the n best are the choices, in beam order, each with its score; "
                          "deterministic (temperature, top_p, top_k and seed do not apply); not streamed")
    length_penalty: float | None = Field(None, ge=-100, le=100, description="extension (vLLM's): beam search: a "
                                         "finished beam's score is its log-prob sum / its length ** length_penalty "
                                         "(default 1)")
    early_stopping: bool | Literal["never"] | None = Field(
        None, description="extension (vLLM's): beam search: true (stop once best_of beams finished), false (once "
                          "none can improve) or \"never\", transformers' meanings (default false)")
    penalty_alpha: float | None = Field(None, ge=0, le=1, description="extension (transformers'): contrastive search "
                                        "over top_k > 1 candidates (0 = off); deterministic, n 1, not streamed")
    interventions: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_SPEC)]],
                             Field(max_length=MAX_INTERVENTIONS)] | None = Field(
        None, description="extension: changes to the network while this request's rows run, as gpt2kit generate's "
                          "flags write them: 'NAME' (zero it, e.g. h.9.attn.head.9), 'NAME:VECTOR*SCALE' (add a vector "
                          "the server was given with --steer-vector), 'clamp:SAE:FEATURE=VALUE' (an SAE given with "
                          "--sae); only on a server started with --allow-interventions")

    # structured outputs (gpt2kit.sampling.constraint; docs/structured.md)
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's (an extension on completions): json_object or json_schema constrain the output")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension (vLLM's): json, regex, choice, grammar or json_object constrains the output")

    def constraint(self):
        """The request's structured-output Constraint, or None; SettingError (a 400) naming the field."""
        from gpt2kit.sampling.constraint import Constraint
        from gpt2kit.validate import SettingError

        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise SettingError("response_format and structured_outputs each constrain the output: send one",
                               "structured_outputs")
        if rf is not None and rf.type == "json_object":
            return Constraint("json_object")
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise SettingError("response_format of type json_schema needs its json_schema", "response_format")
            schema = rf.json_schema.schema_
            return Constraint("json_object") if schema is None else Constraint.json_schema(schema)
        if so is None:
            return None
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar), ("json_object", so.json_object or None)) if v is not None]
        if len(given) != 1:
            raise SettingError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                               f"got {len(given)}", "structured_outputs")
        kind, value = given[0]
        if kind == "json":
            return Constraint.json_schema(value)
        return Constraint("json_object") if kind == "json_object" else Constraint(kind, value)

    def warper_settings(self, tokenizer, n_vocab: int, max_tokens: int) -> dict:
        """The SamplingSettings fields of the warper and constraint extensions; ValueError (a 400)
        naming the field and its limit."""
        if self.min_tokens is not None and self.min_tokens > max_tokens:
            raise SettingError(f"min_tokens must be an integer in [0, max_tokens={max_tokens}], got {self.min_tokens}",
                               "min_tokens")
        bad = [t for t in self.suppress_tokens or () if t >= n_vocab]
        if bad:
            raise SettingError(f"suppress_tokens token id {bad[0]} is outside the vocabulary [0, {n_vocab})",
                               "suppress_tokens")
        return dict(min_p=self.min_p or 0.0, typical_p=1.0 if self.typical_p is None else self.typical_p,
                    epsilon_cutoff=self.epsilon_cutoff or 0.0, eta_cutoff=self.eta_cutoff or 0.0,
                    no_repeat_ngram_size=self.no_repeat_ngram_size or 0, min_new_tokens=self.min_tokens or 0,
                    bad_words=bad_words_ids(tokenizer, self.bad_words or ()),
                    suppress_tokens=tuple(self.suppress_tokens or ()), structured=self.constraint())


class CompletionRequest(Extensions, _SamplingRequest):
    """POST /v1/completions (the legacy completions API)."""

    prompt: Prompt = Field("<|endoftext|>", description="a string, strings, token ids, or lists of token ids")
    suffix: str | None = Field(None, description="not supported by GPT-2 (must be null)")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo; null: up to the context")
    best_of: int | None = Field(None, ge=1, le=128, description="server-side candidates; n best by mean log-prob")
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: Logprobs | None
    finish_reason: Literal["stop", "length"] | None
    score: float | None = Field(None, description="extension: beam search: the beam's score (log-prob sum / "
                                                  "length ** length_penalty); absent otherwise")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | None = None


class ChatRequest(Extensions, _SamplingRequest):
    """POST /v1/chat/completions: the messages rendered by the chat template (serve/template.py) are
    completed as /v1/completions completes a prompt, with the same extensions and checks."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    best_of: int | None = Field(None, ge=1, le=128, description="extension (completions' field): server-side "
                                                                "candidates, n best by mean log-prob; beam search's "
                                                                "width")
    stream_options: StreamOptions | None = None


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None
    score: float | None = Field(None, description="extension: beam search: the beam's score, as on completions; "
                                                  "absent otherwise")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gpt2kit"
    max_model_len: int | None = None
    quantization: str | None = None  # "int8" for a weight-only int8 model (docs/quantization.md), else null
    root: str | None = None  # the base's name, or a LoRA adapter's directory (vLLM's)
    parent: str | None = None  # a LoRA adapter's base; null for the base


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


# A token's text, or its bytes (a list of 0-255) when they are not valid UTF-8 on their own.
Piece = str | list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = _STRICT
    lora_name: str = Field(description="the model name requests will send")
    lora_path: str = Field(description="an adapter directory on the server (peft's format)")


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id, vLLM's internal id, is accepted and not used)."""

    model_config = _STRICT
    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = Field(True, description="<|endoftext|> in the text is the special token")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    pieces: list[Piece] = Field(description="extension: each token's text, or its bytes when not valid UTF-8 alone")


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the text; bytes that are not valid UTF-8 become U+FFFD")
    pieces: list[Piece] = Field(description="extension: each token's text, or its bytes when not valid UTF-8 alone")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody
