"""Triton Python backend model (decoupled): lookahead decoding with trt_lookahead.LookaheadRuntime.

Written by `trt-lookahead triton-repo`; config.pbtxt's `parameters` say which model to load.
One LookaheadRuntime per model instance serves up to `max_batch` requests at once, batched in every
step by its scheduler (one copy of the weights); more wait in its queue. execute() only takes each
request's inputs and hands the request to a thread of its own, which checks it (the runtime bounds a
prompt's size and the stop list before tokenizing or matching), queues it and sends its responses: one
request's size never holds up the instance's others. A cancelled request (or a client gone) leaves the
queue at once, or a running one at the next step, freeing its slot. `instance_group.count` runs more
instances.

Inputs and outputs are trt_lookahead.serving.schema's (TensorRT-LLM ensemble names; all but text_input
optional; the lookahead inputs at most the served config, unset ones taking the served value;
lookahead_window_size 0 means no lookahead for this request; no lookahead input at all: the served
config, `auto` included, where the policy chooses each step). The
same names, and `chat` (wrap text_input in the chat template), are also read from the request
parameters when no tensor of that name is sent; any other request parameter is refused.
finish_reason is "length", "stop", or "" while streaming. With stream=true: one response per accepted
block (new text only; token and step counts so far), then a final one with the held-back rest of the
text, the totals and the finish reason. Otherwise one response with the whole text. Every bad request
that reaches this model gets an INVALID_ARG error (HTTP 400); a full queue gets UNAVAILABLE (503);
INTERNAL (500) is a bug, logged with its traceback.
"""

import json
import os
import sys
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WAITING_POLL_SECONDS = 0.2  # how often a request waiting for a slot checks whether its client has cancelled
ACCEPTED = {str: str, bool: bool, int: int, float: (int, float)}  # from tensors or JSON request parameters


class BadRequest(ValueError):
    pass


def _find_trt_lookahead(writer_path):
    """trt_lookahead from the directory that wrote this repository (config.pbtxt's trt_lookahead_path) if it
    is there, else the one installed in the stub's Python: the writer's package is the one whose inputs
    config.pbtxt declares, and the stub ignores PYTHONPATH (its sys.flags.ignore_environment is set)."""
    if writer_path and os.path.isfile(os.path.join(writer_path, "trt_lookahead", "__init__.py")):
        sys.path.insert(0, writer_path)


class TritonPythonModel:
    def initialize(self, args):
        import torch

        model_config = json.loads(args["model_config"])
        instances = sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [{}])) or 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // instances))  # the instances share the cores
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        _find_trt_lookahead(params.get("trt_lookahead_path"))
        import trt_lookahead
        from trt_lookahead.lookahead.config import Lookahead
        from trt_lookahead.lookahead.decoder import length_error
        from trt_lookahead.runtime import DEFAULT_MAX_NEW_TOKENS, LookaheadRuntime
        from trt_lookahead.runtime.scheduler import QueueFull
        from trt_lookahead.serving import schema

        self._lookahead_type = Lookahead
        self._length_error = length_error
        self._queue_full = QueueFull
        self.schema = schema
        self.batched = model_config.get("max_batch_size", 0) > 0
        self.default_max_tokens = int(params.get("default_max_tokens") or DEFAULT_MAX_NEW_TOKENS)
        source = params.get("engine") or params.get("model")
        max_seq_len = params.get("max_seq_len")
        max_batch = params.get("max_batch")
        self.runtime = LookaheadRuntime.from_pretrained(
            source,
            backend=params.get("backend") or None,
            dtype=params.get("dtype") or "float32",
            lookahead=params.get("lookahead_config") or None,  # None: `auto`, the runtime's default
            max_seq_len=int(max_seq_len) if max_seq_len else None,
            verify=params.get("verify") != "false",
            max_batch=int(max_batch) if max_batch else None,
            pool_scope=params.get("pool_scope") or "shared",
            weights=params.get("weights") or "float",  # a checkpoint's quantized engine, built by triton-repo
            activations=params.get("activations") or None,
            tensor_parallel=int(params.get("tensor_parallel") or 1),  # rank processes this instance starts
        )
        self.served = self.runtime.lookahead.ceiling  # per-request lookahead inputs fit inside it
        self.runtime.generate([1], max_new_tokens=2)  # warm the executor now, not on the first request
        self.name = f"{args['model_name']}[{args['model_instance_name']}]"
        pb_utils.Logger.log_info(
            f"{self.name}: {source} backend={self.runtime.backend} dtype={self.runtime.dtype} "
            f"lookahead={self.runtime.lookahead} (largest {self.served}) max_batch={self.runtime.max_batch} "
            f"max_seq_len={self.runtime.max_seq_len} pool_scope={self.runtime.pool_scope} "
            f"threads={torch.get_num_threads()} "
            f"trt_lookahead={os.path.dirname(trt_lookahead.__file__)}"
        )

    # -- request parsing ---------------------------------------------------------------------------

    def _inputs(self, request):
        """(its parameters' JSON text, {name: array} of the input tensors sent): what the request's thread reads.

        Copied here, in execute(): the request's own tensors are the backend's until execute() returns."""
        tensors = {}
        for name in self.schema.INPUT:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                tensors[name] = np.array(tensor.as_numpy(), copy=True)  # strings: the references only
        return request.parameters() or "{}", tensors

    def _value(self, tensors, parameters, name, default=None):
        """One scalar input: the tensor if sent, else the request parameter, else `default` or the schema's."""
        field = self.schema.INPUT[name]
        kind, default = field.kind, field.default if default is None else default
        array = tensors.get(name)
        if array is None:
            if name not in parameters:
                return default
            value = parameters[name]
        else:
            if array.size != 1:
                raise BadRequest(f"{name} must hold one value, got shape {list(array.shape)}")
            value = array.reshape(-1)[0]
            if isinstance(value, np.generic):
                value = value.item()
        if kind is str and isinstance(value, bytes):
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadRequest(f"{name} is not valid UTF-8: {exc}") from None
        if isinstance(value, ACCEPTED[kind]) and (kind is bool or not isinstance(value, bool)):
            return kind(value)
        raise BadRequest(f"{name} must be {kind.__name__}, got {type(value).__name__} {value!r}")

    def _parse(self, parameters, tensors):
        """(prompt text, max_tokens, stream, the runtime's keyword arguments); BadRequest naming a bad input."""
        parameters = json.loads(parameters)
        unknown = sorted(set(parameters) - set(self.schema.INPUT) - set(self.schema.RESERVED_PARAMETERS))
        if unknown:  # a typo ("temprature") would otherwise be ignored in silence
            raise BadRequest(
                f"unknown request parameter(s) {', '.join(unknown)}; this model reads {', '.join(self.schema.INPUT)}"
            )
        prompt = self._value(tensors, parameters, "text_input")  # one prompt per request
        if prompt is None:
            raise BadRequest("text_input is required: send the prompt text as text_input")
        max_tokens = self._value(tensors, parameters, "max_tokens", self.default_max_tokens)
        stop = tensors.get("stop_words")
        if stop is not None:
            stop_words = [w.decode("utf-8", "replace") if isinstance(w, bytes) else str(w) for w in stop.reshape(-1)]
        else:
            stop_words = parameters.get("stop_words", [])
            stop_words = [stop_words] if isinstance(stop_words, str) else stop_words
            if not isinstance(stop_words, list) or not all(isinstance(w, str) for w in stop_words):
                raise BadRequest(f"stop_words must be a list of strings, got {stop_words!r}")
        kwargs = dict(
            temperature=self._value(tensors, parameters, "temperature"),
            top_k=self._value(tensors, parameters, "top_k"),
            top_p=self._value(tensors, parameters, "top_p"),
            seed=self._value(tensors, parameters, "random_seed"),
            stop=stop_words,  # the runtime bounds their number and length, and drops empty ones
            lookahead=self._lookahead(tensors, parameters),
            pool_scope=self._value(tensors, parameters, "pool_scope"),
            chat=self._value(tensors, parameters, "chat"),
        )
        return prompt, max_tokens, self._value(tensors, parameters, "stream"), kwargs

    def _lookahead(self, tensors, parameters):
        """The request's lookahead inputs as a choice (trt_lookahead.lookahead.config.Lookahead)."""
        values = [self._value(tensors, parameters, name) for name in self.schema.LOOKAHEAD_INPUTS]
        if all(v is None for v in values):
            return self.runtime.lookahead  # the served default: W,N,G, or `auto`
        if values[0] == 0:
            return self._lookahead_type.greedy()  # window size 0: no lookahead for this request
        try:
            return self._lookahead_type.from_parts(values, self.served, self.schema.LOOKAHEAD_INPUTS)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    # -- responses ---------------------------------------------------------------------------------

    def _response(self, text, prompt_tokens, generated_tokens, steps, finish_reason=""):
        shape = (1, 1) if self.batched else (1,)
        values = (text.encode("utf-8"), prompt_tokens, generated_tokens, steps, finish_reason.encode("utf-8"))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(field.name, np.array([value], dtype=field.numpy_dtype).reshape(shape))
            for field, value in zip(self.schema.OUTPUTS, values, strict=True)
        ])

    def _error(self, sender, message, code):
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)
        except Exception as exc:  # the request is already complete (e.g. cancelled): nothing left to tell
            pb_utils.Logger.log_warn(f"{self.name}: could not send the error {message!r}: {exc}")

    def execute(self, requests):
        """Take each request's inputs and return: a thread per request checks, queues and answers it."""
        for request in requests:
            sender = request.get_response_sender()
            rid = request.request_id()
            try:
                parameters, tensors = self._inputs(request)
                threading.Thread(target=self._serve, args=(rid, sender, parameters, tensors),
                                 name=f"{self.name} request {rid!r}", daemon=True).start()
            except Exception as exc:  # keep serving: report this request's failure, log the traceback
                self._failed(rid, sender, exc)
        return None

    def _serve(self, rid, sender, parameters, tensors):
        """One request, in its own thread: check it (INVALID_ARG naming the problem), queue it (UNAVAILABLE when
        the queue is full) and send its responses."""
        try:
            prompt, max_tokens, stream, kwargs = self._parse(parameters, tensors)
            prompt_ids = self.runtime.encode(prompt, chat=kwargs.pop("chat"))  # its size bounded first
            problem = self._length_error(len(prompt_ids), max_tokens, self.runtime.max_seq_len, tokens="max_tokens",
                                         context="the model's max_seq_len", grow="")
            if problem is not None:
                raise BadRequest(problem.message)
            chunks = self.runtime.stream(prompt_ids, max_tokens, **kwargs)  # checked and queued here
        except self._queue_full as exc:
            self._error(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)
            return
        except (BadRequest, ValueError) as exc:  # ValueError: the runtime's checks (UserError)
            self._error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
            return
        except Exception as exc:  # keep serving: report this request's failure, log the traceback
            self._failed(rid, sender, exc)
            return
        self._send(rid, sender, chunks, max_tokens, stream)

    def _failed(self, rid, sender, exc):
        pb_utils.Logger.log_error(f"{self.name}: request {rid!r} failed:\n{traceback.format_exc()}")
        self._error(sender, f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)

    def _send(self, rid, sender, chunks, max_tokens, stream):
        """Stream one request's chunks as responses; a cancelled request leaves the queue at once (checked while
        it waits for a slot), or its slot at the next step."""
        generated = steps = 0
        text = []
        started = time.perf_counter()
        try:
            prompt_tokens = len(chunks.request.prompt_ids)
            while not chunks.handle.wait_dequeued(WAITING_POLL_SECONDS):  # no chunk before a slot: watch meanwhile
                if sender.is_cancelled():
                    self._cancel(rid, sender, chunks, "while waiting for a slot")
                    return
                time.sleep(WAITING_POLL_SECONDS)
            for chunk in chunks:
                if chunk.done:
                    out = chunk.output
                    final_text = chunk.text if stream else "".join(text) + chunk.text
                    sender.send(
                        self._response(final_text, out.prompt_tokens, out.generated_tokens, out.steps,
                                       out.finish_reason),
                        flags=FINAL,
                    )
                    return
                if sender.is_cancelled():
                    self._cancel(rid, sender, chunks, f"after {generated} of {max_tokens} tokens, {steps} steps, "
                                 f"{time.perf_counter() - started:.3f} s")
                    return
                generated += len(chunk.token_ids)
                steps += 1
                if stream:
                    sender.send(self._response(chunk.text, prompt_tokens, generated, steps))
                else:
                    text.append(chunk.text)
        except Exception as exc:  # this request only: the others and the server go on
            self._failed(rid, sender, exc)
        finally:
            chunks.close()  # cancels the request even if it never sent a chunk

    def _cancel(self, rid, sender, chunks, when):
        """The client cancelled: the request leaves the queue now, or its slot at the next step."""
        pb_utils.Logger.log_info(f"{self.name}: request {rid!r} cancelled {when}")
        chunks.close()
        sender.send(flags=FINAL)

    def finalize(self):
        self.runtime.close()  # requests still running end with an error; the scheduler thread stops
        self.runtime = None
