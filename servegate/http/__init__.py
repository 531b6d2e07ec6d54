"""servegate's one HTTP stack.

::

    session     blocking requests (requests + urllib3): make_session (sends the API key),
                request_within / stream_within (whole-request deadlines), ThreadSessions,
                served_model_name, JSON and URL helpers — every stage and engine uses these
    streaming   StreamingClient: the serving load generator's streamed POSTs (asyncio +
                httptools), body bytes handed to a StreamSink from the socket callback
    errors      the one mapping of transport failures: unreachable_as_error,
                connection_lost_error, deadline_error

No ``requests``, urllib3 or socket exception leaks out of this package: a failed connection
is ``ServerUnreachableError``, a request past its deadline ``RequestDeadlineError``.
"""

from servegate.http.errors import connection_lost_error, deadline_error, unreachable_as_error
from servegate.http.session import (
    ThreadSessions,
    api_key_headers,
    body_excerpt,
    join_url,
    json_body,
    make_session,
    request_within,
    served_model_name,
    stream_within,
)
from servegate.http.streaming import StreamingClient, StreamSink

__all__ = [
    "api_key_headers",
    "make_session",
    "ThreadSessions",
    "request_within",
    "stream_within",
    "served_model_name",
    "join_url",
    "json_body",
    "body_excerpt",
    "StreamingClient",
    "StreamSink",
    "unreachable_as_error",
    "connection_lost_error",
    "deadline_error",
]
