"""narwhal/gateway/protos.py: the ext_proc descriptors the picker carries build the
messages and the service Envoy calls, with the fields the picker reads and writes, and
coexist with opentelemetry-proto (which xds-protos, not a dependency, would overwrite)."""

from __future__ import annotations

import pytest

from narwhal.gateway.protos import METHOD, SERVICE, core, ext_proc, messages, struct


@pytest.mark.parametrize(("message", "fields"), [
    ("ProcessingRequest", {"request_headers", "response_headers", "request_body", "response_body", "request_trailers", "response_trailers", "metadata_context"}),
    ("ProcessingResponse", {"request_headers", "response_headers", "request_body", "response_body", "request_trailers", "response_trailers",
                            "immediate_response", "dynamic_metadata"}),
    ("ImmediateResponse", {"status", "headers", "body", "details"}),
    ("CommonResponse", {"status", "header_mutation", "body_mutation"}),
    ("BodyMutation", {"body", "clear_body", "streamed_response"}),
    ("StreamedBodyResponse", {"body", "end_of_stream"}),
    ("HttpBody", {"body", "end_of_stream"}),
    ("HttpHeaders", {"headers", "end_of_stream"}),
    ("HeaderMutation", {"set_headers", "remove_headers"}),
])
def test_the_messages_have_the_fields_the_picker_uses(message: str, fields: set[str]) -> None:
    assert fields <= {f.name for f in getattr(ext_proc, message).DESCRIPTOR.fields}


def test_the_service_and_a_round_trip() -> None:
    svc = ext_proc.ProcessingRequest.DESCRIPTOR.file.services_by_name["ExternalProcessor"]
    assert svc.full_name == SERVICE and f"/{SERVICE}/Process" == METHOD
    m = svc.methods_by_name["Process"]
    assert m.client_streaming and m.server_streaming
    meta = struct.Struct()
    meta.update({"envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.7:8000"}})
    opt = core.HeaderValueOption(header=core.HeaderValue(key="k", raw_value=b"v"), append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    r = ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
        header_mutation=ext_proc.HeaderMutation(set_headers=[opt]))), dynamic_metadata=meta)
    back = ext_proc.ProcessingResponse.FromString(r.SerializeToString())
    assert back == r and back.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value == "10.0.0.7:8000"
    assert len(messages()) > 100


def test_opentelemetry_proto_is_its_own() -> None:
    """The OTLP exporter imports (it fails when another package's copy of the
    opentelemetry/proto modules replaced opentelemetry-proto's)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope

    assert OTLPSpanExporter is not None and InstrumentationScope.DESCRIPTOR.full_name == "opentelemetry.proto.common.v1.InstrumentationScope"
