"""Request and response models of the server's routes (pydantic), and the one error shape.

Requests are strict (no string-to-number or number-to-string coercion): a wrong JSON type is a 422
naming the field. Every error the server sends is `ErrorBody`: a message, a kind, and the field and
limit it concerns where there is one.
"""

from __future__ import annotations

from typing import Literal, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

Texts = Union[str, list[str]]
TEXTS = "a string or a list of strings"
DIRECTION = "'right' (keep the start) or 'left' (keep the end)"
PREDICT_INPUTS = ("a string, a pair of strings [text_a, text_b], or a batch of them as lists "
                  "[[text], [text_a, text_b], ...]")
Direction = Literal["right", "left", "Right", "Left"]
Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]
MODEL = "the name of a served model (GET /v1/models; default: the first)"
ADAPTER = "the name of one of the model's LoRA adapters (--adapter), or null: the base model"
PRECISION = ("'float32', or quantized as sentence-transformers' quantize_embeddings: 'binary', 'ubinary' (packed sign "
             "bits), 'int8', 'uint8' (these two with the server's --ranges)")


class Request(BaseModel):
    model_config = ConfigDict(strict=True)


class TextsRequest(Request):
    """The fields TEI's text routes share (what `routes_tei.run_text_rows` reads): the inputs, their truncation and
    prompt, the model and its adapter."""

    inputs: Texts = Field(description=TEXTS)
    truncate: bool = Field(False, description="a boolean")
    truncation_direction: Direction = Field("right", description=DIRECTION)
    prompt_name: str | None = Field(None, description="the name of one of the model's configured prompts")
    model: str | None = Field(None, description=MODEL)
    adapter: str | None = Field(None, description=ADAPTER)


class EmbedRequest(TextsRequest):
    """TEI's /embed. normalize None follows the checkpoint (its Normalize module), as Encoder.encode; with
    `dimensions`, a normalizing model's prefix is renormalized (as /v1/embeddings)."""

    normalize: bool | None = Field(None, description="true, false or null (the model's own configuration)")
    dimensions: int | None = Field(None, description="a positive integer, at most the model's dimension")
    precision: Precision = Field("float32", description=PRECISION)


class SimilarityInput(Request):
    source_sentence: str = Field(description="a non-empty string")
    sentences: list[str] = Field(description="a list of non-empty strings")


class SimilarityParameters(Request):
    truncate: bool = Field(False, description="a boolean")
    truncation_direction: Direction = Field("right", description=DIRECTION)
    prompt_name: str | None = Field(None, description="the name of one of the model's configured prompts")


class SimilarityRequest(Request):
    """TEI's /similarity (and Hugging Face's sentence-similarity task): each sentence's cosine similarity to the
    source sentence."""

    inputs: SimilarityInput = Field(description='an object {"source_sentence": a string, "sentences": a list of '
                                                'strings}')
    parameters: SimilarityParameters | None = Field(None, description="an object with truncate, "
                                                                      "truncation_direction, prompt_name, or null")
    model: str | None = Field(None, description=MODEL)
    adapter: str | None = Field(None, description=ADAPTER)


class EmbedAllRequest(TextsRequest):
    """TEI's /embed_all: every token's final hidden state, special and prompt tokens included."""


class EmbedSparseRequest(TextsRequest):
    """TEI's /embed_sparse (SPLADE models; BGE-M3's lexical weights)."""


class EmbedMultiRequest(Request):
    """bertfast's /embed_multi (ColBERT and BGE-M3 models): every text's normalized token vectors."""

    inputs: Texts = Field(description=TEXTS)
    is_query: bool | None = Field(None, description="a boolean: true for queries, false for documents (ColBERT: "
                                                    "required; BGE-M3 encodes both alike)")
    truncate: bool = Field(False, description="a boolean")
    prompt_name: str | None = Field(None, description="the name of one of the model's configured prompts")
    model: str | None = Field(None, description=MODEL)
    adapter: str | None = Field(None, description=ADAPTER)


class SparseValue(BaseModel):
    index: int
    value: float


class PredictRequest(Request):
    """TEI's /predict (sequence classifiers and rerankers): one input or a batch. A list of two strings is
    one pair, as TEI reads it; a batch is a list of lists of one or two strings."""

    inputs: Union[str, list[str], list[list[str]]] = Field(description=PREDICT_INPUTS)
    raw_scores: bool = Field(False, description="a boolean (true: the logits, no softmax/sigmoid)")
    truncate: bool = Field(False, description="a boolean")
    truncation_direction: Direction = Field("right", description=DIRECTION)
    model: str | None = Field(None, description=MODEL)
    adapter: str | None = Field(None, description=ADAPTER)


class Prediction(BaseModel):
    score: float
    label: str


class RerankRequest(Request):
    """TEI's /rerank (cross-encoders): each text scored as the pair (query, text)."""

    query: str = Field(description="a non-empty string")
    texts: list[str] = Field(description="a list of non-empty strings")
    raw_scores: bool = Field(False, description="a boolean (true: the logit, no sigmoid)")
    return_text: bool = Field(False, description="a boolean")
    truncate: bool = Field(False, description="a boolean")
    truncation_direction: Direction = Field("right", description=DIRECTION)
    model: str | None = Field(None, description=MODEL)
    adapter: str | None = Field(None, description=ADAPTER)


class Rank(BaseModel):
    index: int
    text: str | None = None  # only with return_text
    score: float


class TokenizeRequest(Request):
    inputs: Texts = Field(description=TEXTS)
    add_special_tokens: bool = Field(True, description="a boolean")
    model: str | None = Field(None, description=MODEL)


class DecodeRequest(Request):
    """TEI's /decode: token ids back to text, /tokenize's inverse."""

    ids: Union[list[int], list[list[int]]] = Field(description="a list of token ids or a list of lists of them")
    skip_special_tokens: bool = Field(True, description="a boolean")
    model: str | None = Field(None, description=MODEL)


class Token(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class OpenAIEmbeddingRequest(Request):
    """OpenAI's /v1/embeddings. Token ids are the model's own vocabulary, special tokens included."""

    input: Union[str, list[str], list[int], list[list[int]]] = Field(
        description="a string, a list of strings, a list of token ids or a list of lists of token ids")
    model: str | None = Field(None, description="a string: " + MODEL + "; any value when one model is served; "
                                                "MODEL:ADAPTER for one of its LoRA adapters")
    encoding_format: Literal["float", "base64"] = Field("float", description="'float' or 'base64'")
    dimensions: int | None = Field(None, description="a positive integer, at most the model's dimension")
    user: str | None = Field(None, description="a string")
    precision: Precision = Field("float32", description=PRECISION + "; with encoding_format 'base64', the bytes")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], list[int], str]
    index: int


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    """OpenAI's model object."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Info(BaseModel):
    model_id: str
    model_dir: str
    model_type: Literal["embedding", "classifier", "reranker", "sparse", "colbert", "bge-m3"]
    architecture: str | None
    routes: list[str]  # the model routes this model answers (every model answers /tokenize and the rest)
    default_route: str  # what POST / and POST /invocations answer for this model (TEI's choice by model type)
    labels: list[str] | None  # classifier and reranker: label names in logit order
    dimension: int | None  # embedding models, BGE-M3 (dense); sparse: the vocabulary size; ColBERT: token vectors
    max_input_length: int  # ColBERT: its document_length
    max_query_length: int | None  # ColBERT: its query_length
    token_dimension: int | None  # ColBERT and BGE-M3: the width of /embed_multi's token vectors
    pooling: list[str] | None
    normalizes: bool | None
    dtype: str
    backend: str
    isa: str
    cpu: str
    max_batch_tokens: int
    max_concurrent_requests: int
    max_client_batch_size: int
    max_body_bytes: int
    version: str


class AdapterLoadRequest(Request):
    """The admin route's load: a LoRA adapter directory under the server's --adapter-root, served as `name`."""

    name: str = Field(description="a non-empty string without ':', not the name of a loaded adapter")
    path: str = Field(description="a directory relative to the server's --adapter-root (no '..', no symlink out of "
                                  "it) holding adapter_config.json and adapter_model.safetensors")
    model: str | None = Field(None, description=MODEL)


class AdapterState(BaseModel):
    model: str
    adapters: list[str]


class ErrorBody(BaseModel):
    error: str
    error_type: str
    field: str | None = None
    limit: int | None = None


class ApiError(Exception):
    """Raised by a route: becomes an `ErrorBody` with this status."""

    def __init__(self, status: int, message: str, kind: str = "validation", field: str | None = None,
                 limit: int | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.field, self.limit = status, message, kind, field, limit

    def body(self) -> dict:
        return ErrorBody(error=self.message, error_type=self.kind, field=self.field, limit=self.limit).model_dump()

    def response(self, headers=None) -> JSONResponse:
        """The error as the server sends it: its body as JSON, with its status."""
        return JSONResponse(self.body(), self.status, headers=headers)


class OpenAIError(ApiError):
    """An error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: the /v1 routes' unknown model."""

    def __init__(self, status: int, message: str, kind: str, *, param: str | None = None, code: str | None = None):
        super().__init__(status, message, kind, field=param)
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.field, "code": self.code}}


def invalid_request(errors: list[dict], schema: type[BaseModel] | None) -> ApiError:
    """pydantic's validation errors of a body (the first one) as the server's 400 (invalid JSON) or 422, naming the
    field and, where `schema` describes it, what it must be."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", field="body")
    loc = [str(p) for p in first["loc"] if p != "body"]
    field = loc[0] if loc else "body"
    hint = schema.model_fields[field].description if schema and field in schema.model_fields else None
    message = f"{field} must be {hint}" if hint else f"{field}: {first['msg']}"
    if first["type"] == "missing":
        message = f"{field} is required" + (f": {hint}" if hint else "")
    elif not loc:
        message = "the body must be a JSON object"
    return ApiError(422, message, field=field)


def json_response(content) -> Response:
    """A JSON response by orjson; numpy arrays inside are written as lists (float64: pass them widened)."""
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")
