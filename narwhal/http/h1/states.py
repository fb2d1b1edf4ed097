"""The states of an HTTP/1.1 server connection, both sides', as a table (h11's model).

Each side (CLIENT, SERVER) has a state. An event a side sends moves it by
EVENT_TRIGGERED (role -> state -> event kind -> next state; a kind missing is a protocol
error), then the pair is settled by STATE_TRIGGERED and three rules, repeated until
nothing moves:
  S1  a protocol switch proposed and the client DONE: the client MIGHT_SWITCH_PROTOCOL;
      none proposed and the client MIGHT_SWITCH_PROTOCOL: back to DONE;
  S2  keep-alive off: a side that is DONE is MUST_CLOSE;
  S3  STATE_TRIGGERED[(client, server)] moves one side.
A Request from the client also moves the server IDLE -> SEND_RESPONSE (row E-REQ).
`start_next_cycle` is allowed only from (DONE, DONE) with keep-alive on.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "State", "CLIENT", "SERVER", "IDLE", "SEND_RESPONSE", "SEND_BODY", "DONE", "MUST_CLOSE", "CLOSED", "ERROR",
    "MIGHT_SWITCH_PROTOCOL", "SWITCHED_PROTOCOL", "SWITCH_UPGRADE", "SWITCH_CONNECT", "EVENT_TRIGGERED", "STATE_TRIGGERED", "ConnState",
]


class State:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


CLIENT, SERVER = State("CLIENT"), State("SERVER")
IDLE, SEND_RESPONSE, SEND_BODY, DONE = State("IDLE"), State("SEND_RESPONSE"), State("SEND_BODY"), State("DONE")
MUST_CLOSE, CLOSED, ERROR = State("MUST_CLOSE"), State("CLOSED"), State("ERROR")
MIGHT_SWITCH_PROTOCOL, SWITCHED_PROTOCOL = State("MIGHT_SWITCH_PROTOCOL"), State("SWITCHED_PROTOCOL")
SWITCH_UPGRADE, SWITCH_CONNECT = State("SWITCH_UPGRADE"), State("SWITCH_CONNECT")  # the client's proposals

# event kinds are names: "request", "data", "end", "closed", "response", "informational";
# a server's switch is (kind, proposal)
EVENT_TRIGGERED: dict[State, dict[State, dict[Any, State]]] = {
    CLIENT: {
        IDLE: {"request": SEND_BODY, "closed": CLOSED},
        SEND_BODY: {"data": SEND_BODY, "end": DONE},
        DONE: {"closed": CLOSED},
        MUST_CLOSE: {"closed": CLOSED},
        CLOSED: {"closed": CLOSED},
        MIGHT_SWITCH_PROTOCOL: {},
        SWITCHED_PROTOCOL: {},
        ERROR: {},
    },
    SERVER: {
        IDLE: {"closed": CLOSED, "response": SEND_BODY, ("request", CLIENT): SEND_RESPONSE},  # E-REQ
        SEND_RESPONSE: {
            "informational": SEND_RESPONSE,
            "response": SEND_BODY,
            ("informational", SWITCH_UPGRADE): SWITCHED_PROTOCOL,
            ("response", SWITCH_CONNECT): SWITCHED_PROTOCOL,
        },
        SEND_BODY: {"data": SEND_BODY, "end": DONE},
        DONE: {"closed": CLOSED},
        MUST_CLOSE: {"closed": CLOSED},
        CLOSED: {"closed": CLOSED},
        SWITCHED_PROTOCOL: {},
        ERROR: {},
    },
}

STATE_TRIGGERED: dict[tuple[State, State], dict[State, State]] = {
    (MIGHT_SWITCH_PROTOCOL, SWITCHED_PROTOCOL): {CLIENT: SWITCHED_PROTOCOL},
    (CLOSED, DONE): {SERVER: MUST_CLOSE},
    (CLOSED, IDLE): {SERVER: MUST_CLOSE},
    (ERROR, DONE): {SERVER: MUST_CLOSE},
    (DONE, CLOSED): {CLIENT: MUST_CLOSE},
    (IDLE, CLOSED): {CLIENT: MUST_CLOSE},
    (DONE, ERROR): {CLIENT: MUST_CLOSE},
}

_NONE: frozenset[State] = frozenset()


class ConnState:
    """Both sides' states, keep-alive and the client's pending switch proposals (one
    shared empty set while there are none: nothing allocated per request)."""

    __slots__ = ("client", "server", "keep_alive", "proposals")

    def __init__(self) -> None:
        self.client = IDLE
        self.server = IDLE
        self.keep_alive = True
        self.proposals: frozenset[State] = _NONE

    def of(self, role: State) -> State:
        return self.client if role is CLIENT else self.server

    def _set(self, role: State, state: State) -> None:
        if role is CLIENT:
            self.client = state
        else:
            self.server = state

    def propose(self, switch: State) -> None:
        self.proposals = self.proposals | {switch}
        self._settle()

    def error(self, role: State) -> None:
        self._set(role, ERROR)
        self._settle()

    def keep_alive_off(self) -> None:
        self.keep_alive = False
        self._settle()

    def event(self, role: State, kind: str, switch: State | None = None) -> None:
        """`role` sent an event of `kind` (`switch`: the proposal a server's answer accepts).
        Raises KeyError for a kind its state does not take (the caller's protocol error)."""
        key: Any = kind if switch is None else (kind, switch)
        if switch is None and kind == "response":
            self.proposals = _NONE  # a plain response declines every proposal
        self._set(role, EVENT_TRIGGERED[role][self.of(role)][key])
        if kind == "request":  # E-REQ
            self._set(SERVER, EVENT_TRIGGERED[SERVER][self.server][("request", CLIENT)])
        self._settle()

    def _settle(self) -> None:
        while True:
            start = (self.client, self.server)
            if self.proposals and self.client is DONE:  # S1
                self.client = MIGHT_SWITCH_PROTOCOL
            if not self.proposals and self.client is MIGHT_SWITCH_PROTOCOL:
                self.client = DONE
            if not self.keep_alive:  # S2
                if self.client is DONE:
                    self.client = MUST_CLOSE
                if self.server is DONE:
                    self.server = MUST_CLOSE
            move = STATE_TRIGGERED.get((self.client, self.server))  # S3
            if move is not None:
                for role, state in move.items():
                    self._set(role, state)
            if (self.client, self.server) == start:
                return

    def start_next_cycle(self) -> bool:
        """(DONE, DONE) with keep-alive on -> (IDLE, IDLE); False (nothing changed) otherwise."""
        if self.client is not DONE or self.server is not DONE:
            return False
        self.client = self.server = IDLE
        return True
