"""Typed service errors: each carries its HTTP status and a stable code for clients."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

# What pydantic puts before a validator's own message: the client reads the message alone.
PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


class ServiceError(Exception):
    """Base of every error a client may see; the API turns it into the JSON error envelope."""

    status = 500
    code = "internal_error"
    message = "The service failed to handle the request."

    def __init__(self, message: str | None = None, *, retry_after: int | None = None,
                 details: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message or self.message)
        self.retry_after = retry_after
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` envelope."""
        error: dict[str, Any] = {"code": self.code, "message": str(self)}
        if self.details is not None:
            error["details"] = self.details
        return {"error": error}


class InvalidJSONError(ServiceError):
    status, code, message = 400, "invalid_json", "The request body is not valid JSON."


class MalformedRequestError(ServiceError):
    """An HTTP request the server could not parse (the web server answers it before the app)."""

    status, code, message = 400, "malformed_request", "The HTTP request is malformed."


class UriTooLongError(ServiceError):
    status, code, message = 414, "uri_too_long", "The request line is longer than the server reads."


class HeadersTooLargeError(ServiceError):
    status, code, message = 431, "headers_too_large", "The request's headers are more than the server reads."


class UnauthorizedError(ServiceError):
    status, code, message = 401, "unauthorized", "Send a valid API key as `Authorization: Bearer <key>`."


class WebhooksDisabledError(ServiceError):
    status, code, message = 400, "webhooks_disabled", "This service sends no webhooks; send none."


class WebhookNotAllowedError(ServiceError):
    status, code, message = 400, "webhook_not_allowed", "The webhook targets a local or private address."


class PriorityNotAllowedError(ServiceError):
    status, code, message = 403, "priority_not_allowed", "This API key may not use this priority."


class AdminDisabledError(ServiceError):
    status, code, message = 403, "admin_disabled", "This service has no admin keys (SLOTQ_ADMIN_KEYS)."


class NotAdminError(ServiceError):
    status, code, message = 403, "not_admin", "This route needs an admin key (SLOTQ_ADMIN_KEYS)."


class NotFoundError(ServiceError):
    status, code, message = 404, "not_found", "No such resource."


class JobNotFoundError(NotFoundError):
    message = "No job with this id."


class MethodNotAllowedError(ServiceError):
    status, code, message = 405, "method_not_allowed", "This method is not allowed on this resource."


class NotWaitingError(ServiceError):
    status, code, message = 409, "not_waiting", "The job does not wait in its line: it runs or has ended."


class AlreadyFinishedError(ServiceError):
    status, code, message = 409, "already_finished", "The job has already ended."


class NotReadyError(ServiceError):
    status, code, message = 409, "not_ready", "The job has no images yet."


class NoPreviewError(ServiceError):
    status, code, message = 409, "no_preview", "The job has no preview now."


class StorageUnavailableError(ServiceError):
    status, code, message = 503, "storage_unavailable", "The result store cannot be reached."


class RangeNotSatisfiableError(ServiceError):
    status, code, message = 416, "range_not_satisfiable", "The range asked for is not within the file."


class ResultExpiredError(ServiceError):
    status, code, message = 410, "expired", "The job's images have expired."


class PayloadTooLargeError(ServiceError):
    status, code, message = 413, "payload_too_large", "The request body is too large."


class UnsupportedMediaTypeError(ServiceError):
    status, code, message = 415, "unsupported_media_type", "Send the body as application/json."


class InvalidRequestError(ServiceError):
    status, code, message = 422, "invalid_request", "The request failed validation."

    @classmethod
    def of(cls, exc: ValidationError) -> InvalidRequestError:
        """The refusal of a body pydantic refused: each error's field and its message alone."""
        return cls(details=[{"loc": list(error["loc"]), "msg": validation_message(error["msg"])}
                            for error in exc.errors(include_url=False, include_input=False)])


def validation_message(message: str) -> str:
    """A pydantic error's message without the prefix pydantic adds to a validator's own."""
    for prefix in PYDANTIC_PREFIXES:
        message = message.removeprefix(prefix)
    return message


class InvalidImageError(ServiceError):
    status, code, message = 422, "invalid_image", "An input image is invalid."


class UnknownLoraError(ServiceError):
    status, code, message = 422, "unknown_lora", "No LoRA adapter of this name is in SLOTQ_LORA_DIR."


class UnknownControlNetError(ServiceError):
    status, code = 422, "unknown_controlnet"
    message = "No ControlNet of this name is in SLOTQ_CONTROLNET_DIR."


class UnknownIpAdapterError(ServiceError):
    status, code = 422, "unknown_ip_adapter"
    message = "No IP-Adapter of this name is in SLOTQ_IP_ADAPTER_DIR."


class UnknownModelError(ServiceError):
    status, code, message = 422, "unknown_model", "No model of this name is in SLOTQ_MODEL_NAMES."


class TooLargeForWorkersError(ServiceError):
    status, code = 422, "too_large_for_workers"
    message = "No live worker of this model can run a job this large."


class QueueFullError(ServiceError):
    status, code, message = 429, "queue_full", "The queue is full; retry later."


class TenantQueueFullError(ServiceError):
    status, code, message = 429, "tenant_queue_full", "This tenant already has its most jobs waiting."


class DeadlineUnmeetableError(ServiceError):
    status, code = 429, "deadline_unmeetable"
    message = "The jobs ahead in this line would keep this one from starting by its deadline_s; retry later."


class TenantWaitShareError(ServiceError):
    status, code = 429, "tenant_wait_share"
    message = ("This API key holds its share of this API process's waiting calls (SLOTQ_TENANT_WAIT_SHARE); "
               "retry soon.")


class TenantStreamShareError(ServiceError):
    status, code = 429, "tenant_stream_share"
    message = ("This API key holds its share of this API process's event streams (SLOTQ_TENANT_WAIT_SHARE); "
               "retry shortly or poll.")


class RateLimitedError(ServiceError):
    status, code, message = 429, "rate_limited", "This API key is over its rate; retry later."


class UnavailableError(ServiceError):
    status, code, message = 503, "unavailable", "The queue is unreachable; retry shortly."


class NotReplicatedError(ServiceError):
    """Admitted on the master, but fewer replicas than SLOTQ_MIN_REPLICAS_ACK confirmed it in time.

    The job exists and may still run; a retry with the same Idempotency-Key replays it (200 once
    replicated) rather than creating a second one.
    """

    status, code = 503, "not_replicated"
    message = "The job is not yet on enough replicas; retry with the same Idempotency-Key."


class TooManyStreamsError(ServiceError):
    status, code = 503, "too_many_streams"
    message = "This API process follows SLOTQ_MAX_STREAMS event streams already; retry shortly or poll."


class SyncWaitExceededError(ServiceError):
    """A synchronous call's job did not end within SLOTQ_SYNC_WAIT_S: it goes on, readable by its id."""

    status, code = 504, "sync_wait_exceeded"
    message = "The job did not end in time; it goes on."


class JobEndedError(ServiceError):
    """A synchronous call's job ended without images: failed (500), canceled (409) or expired (504);
    the code is the job's own error code."""

    STATUSES = {"failed": 500, "canceled": 409, "expired": 504}

    def __init__(self, status: str, code: str, message: str, job_id: str) -> None:
        super().__init__(message)
        self.status, self.code, self.job_status, self.job_id = self.STATUSES[status], code, status, job_id


class TooManyWaitingError(ServiceError):
    status, code = 503, "too_many_waiting"
    message = "This API process holds as many waiting calls as it may (half SLOTQ_API_THREADS); retry soon."


class JobCanceledError(Exception):
    """Raised inside a running job when its cancellation has been requested."""


class JobFailedError(Exception):
    """A job failure with a stable code, recorded on the job for the client to read."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class IdempotencyConflictError(ServiceError):
    status, code, message = 409, "idempotency_conflict", "This Idempotency-Key was used with another body."


class DrainingError(ServiceError):
    status, code, message = 503, "draining", "This API process is shutting down."


class JobInterruptedError(Exception):
    """Raised inside a running job when its worker must stop now; the job goes back to the queue."""


class WorkerFatalError(BaseException):
    """The device is unusable: the worker exits non-zero and its supervisor restarts it.

    A BaseException, like SystemExit, so that no job-level ``except Exception`` swallows it.
    """


class WebhookRefusedError(Exception):
    """A webhook delivery that must not be made: its host resolves to an address it may not reach."""


class WebhookSignatureError(Exception):
    """A webhook delivery whose signature or timestamp does not verify."""
