"""OSWorld's `computer_13` action space: one JSON action per reply, parsed, checked and run through xdotool.

An action is `{"action_type": "CLICK", "parameters": {"x": 120, "y": 40}}`; the parameters may also sit beside
action_type (`{"action_type": "CLICK", "x": 120, "y": 40}`), as OSWorld's controller accepts both. The bare words
WAIT, DONE and FAIL are actions too. A reply may wrap the JSON in a ```json fence or put text around it: the first
JSON object in the reply is the action.

| action_type | parameters (optional in brackets) |
|---|---|
| MOVE_TO | x, y |
| CLICK | [button: left, right, middle], [x, y], [num_clicks: 1-3] |
| MOUSE_DOWN, MOUSE_UP | [button] |
| RIGHT_CLICK, DOUBLE_CLICK | [x, y] |
| DRAG_TO | x, y (the left button held from the pointer's position) |
| SCROLL | dx, dy (clicks of the wheel; positive dy up, positive dx right) |
| TYPING | text |
| PRESS, KEY_DOWN, KEY_UP | key (pyautogui's key names: enter, tab, ctrl, a, f5, ...) |
| HOTKEY | keys (a list, pressed together: ["ctrl", "a"]) |
| WAIT, FAIL, DONE | none |

Coordinates are screen pixels, inside the screen. Anything else (no JSON, an unknown action_type, a missing,
unknown or ill-typed parameter, a key xdotool cannot send) is an `ActionError` whose `kind` is counted by the
environment; the episode goes on with the error as its observation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from posttrain.envs.cua.desktop import Desktop

BUTTONS = {"left": "1", "middle": "2", "right": "3"}
"""Mouse buttons by name, as X numbers them."""

_KEYSYMS = {
    "enter": "Return", "return": "Return", "tab": "Tab", "space": "space", "backspace": "BackSpace",
    "delete": "Delete", "del": "Delete", "esc": "Escape", "escape": "Escape", "up": "Up", "down": "Down",
    "left": "Left", "right": "Right", "home": "Home", "end": "End", "pageup": "Prior", "pgup": "Prior",
    "pagedown": "Next", "pgdn": "Next", "insert": "Insert", "ctrl": "ctrl", "ctrlleft": "Control_L",
    "ctrlright": "Control_R", "shift": "shift", "shiftleft": "Shift_L", "shiftright": "Shift_R", "alt": "alt",
    "altleft": "Alt_L", "altright": "Alt_R", "win": "super", "winleft": "Super_L", "winright": "Super_R",
    "command": "super", "capslock": "Caps_Lock", "numlock": "Num_Lock", "printscreen": "Print",
    "pause": "Pause", "menu": "Menu", "volumeup": "XF86AudioRaiseVolume", "volumedown": "XF86AudioLowerVolume",
    "volumemute": "XF86AudioMute",
    **{f"f{number}": f"F{number}" for number in range(1, 25)},
    **{symbol: name for symbol, name in zip(
        "`-=[]\\;',./!@#$%^&*()_+{}|:\"<>?~ ",
        ["grave", "minus", "equal", "bracketleft", "bracketright", "backslash", "semicolon", "apostrophe", "comma",
         "period", "slash", "exclam", "at", "numbersign", "dollar", "percent", "asciicircum", "ampersand",
         "asterisk", "parenleft", "parenright", "underscore", "plus", "braceleft", "braceright", "bar", "colon",
         "quotedbl", "less", "greater", "question", "asciitilde", "space"])},
}
"""pyautogui's key names (OSWorld's KEYBOARD_KEYS) as X keysyms; letters and digits stand for themselves."""

_NUMBER = (int, float)
_SPEC: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # action_type: (required parameters, optional parameters), each name -> type
    "MOVE_TO": ({"x": _NUMBER, "y": _NUMBER}, {}),
    "CLICK": ({}, {"button": str, "x": _NUMBER, "y": _NUMBER, "num_clicks": int}),
    "MOUSE_DOWN": ({}, {"button": str}),
    "MOUSE_UP": ({}, {"button": str}),
    "RIGHT_CLICK": ({}, {"x": _NUMBER, "y": _NUMBER}),
    "DOUBLE_CLICK": ({}, {"x": _NUMBER, "y": _NUMBER}),
    "DRAG_TO": ({"x": _NUMBER, "y": _NUMBER}, {}),
    "SCROLL": ({"dx": int, "dy": int}, {}),
    "TYPING": ({"text": str}, {}),
    "PRESS": ({"key": str}, {}),
    "KEY_DOWN": ({"key": str}, {}),
    "KEY_UP": ({"key": str}, {}),
    "HOTKEY": ({"keys": list}, {}),
    "WAIT": ({}, {}),
    "FAIL": ({}, {}),
    "DONE": ({}, {}),
}
ACTION_TYPES = tuple(_SPEC)
"""The 16 action types of OSWorld's computer_13 space."""
TERMINAL = ("DONE", "FAIL")
"""Actions that end the episode."""
CLICK_DELAY_MS = 10
"""xdotool's pause after each click (its default, 100 ms, is also spent after a single click); the clicks of a
double or triple click stay far inside any toolkit's multi-click interval."""


class ActionError(ValueError):
    """A reply that is not a valid action. kind: malformed (no JSON object), unknown_action, bad_parameters."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Action:
    """One parsed, checked action."""

    action_type: str
    """One of ACTION_TYPES."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Its parameters, checked against the action space (coordinates rounded to whole pixels)."""


def parse_action(reply: str, screen: tuple[int, int]) -> Action:
    """The action in a model's reply (see the module docstring); ActionError saying what is wrong otherwise.
    screen: (width, height), the bounds coordinates must fall in."""
    text = reply.strip()
    if text.strip("`").strip().upper() in ("WAIT", "DONE", "FAIL"):
        return Action(text.strip("`").strip().upper())
    start = text.find("{")
    if start < 0:
        raise ActionError("malformed", "no action found: reply with one JSON object such as "
                                       '{"action_type": "CLICK", "parameters": {"x": 100, "y": 40}}, or DONE / FAIL')
    try:
        value, _ = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError as error:
        raise ActionError("malformed", f"the action is not valid JSON: {error.msg} at character "
                                       f"{error.pos - start} of the object") from None
    if not isinstance(value, dict) or not isinstance(value.get("action_type"), str):
        raise ActionError("malformed", 'the action needs a string "action_type"')
    action_type = value["action_type"].upper()
    if action_type not in _SPEC:
        raise ActionError("unknown_action", f"unknown action_type {value['action_type']!r}; one of "
                                            f"{', '.join(ACTION_TYPES)}")
    if "parameters" in value:
        if not isinstance(value["parameters"], dict) or len(value) > 2:
            raise ActionError("bad_parameters", '"parameters" must be an object and the only key beside '
                                                '"action_type"')
        parameters = dict(value["parameters"])
    else:
        parameters = {key: item for key, item in value.items() if key != "action_type"}
    return Action(action_type, _checked(action_type, parameters, screen))


def _checked(action_type: str, parameters: dict[str, Any], screen: tuple[int, int]) -> dict[str, Any]:
    required, optional = _SPEC[action_type]
    for name in required:
        if name not in parameters:
            raise ActionError("bad_parameters", f"{action_type} needs the parameter {name!r}")
    for name, item in parameters.items():
        expected = required.get(name, optional.get(name))
        if expected is None:
            known = ", ".join([*required, *optional]) or "none"
            raise ActionError("bad_parameters", f"{action_type} has no parameter {name!r} (its parameters: {known})")
        if isinstance(item, bool) or not isinstance(item, expected):
            raise ActionError("bad_parameters", f"{action_type}: {name} must be "
                                                f"{_type_name(expected)}, got {json.dumps(item)}")
    if ("x" in parameters) != ("y" in parameters):
        raise ActionError("bad_parameters", f"{action_type}: give both x and y, or neither")
    checked = dict(parameters)
    if "x" in checked:
        checked["x"], checked["y"] = round(checked["x"]), round(checked["y"])
        if not (0 <= checked["x"] < screen[0] and 0 <= checked["y"] < screen[1]):
            raise ActionError("bad_parameters", f"{action_type}: ({checked['x']}, {checked['y']}) is off the "
                                                f"{screen[0]}x{screen[1]} screen")
    if "button" in checked and checked["button"] not in BUTTONS:
        raise ActionError("bad_parameters", f"{action_type}: button must be left, right or middle, got "
                                            f"{checked['button']!r}")
    if not 1 <= checked.get("num_clicks", 1) <= 3:
        raise ActionError("bad_parameters", f"{action_type}: num_clicks must be 1, 2 or 3")
    if action_type == "TYPING" and not checked["text"]:
        raise ActionError("bad_parameters", "TYPING: text is empty")
    if "key" in checked:
        keysym(checked["key"])
    if "keys" in checked:
        if not checked["keys"] or not all(isinstance(key, str) for key in checked["keys"]):
            raise ActionError("bad_parameters", "HOTKEY: keys must be a non-empty list of key names")
        for key in checked["keys"]:
            keysym(key)
    return checked


def _type_name(expected: Any) -> str:
    return {str: "a string", int: "an integer", list: "a list"}.get(expected, "a number")


def keysym(key: str) -> str:
    """The X keysym of one of pyautogui's key names; ActionError for a name it does not know."""
    if len(key) == 1 and key.isalnum() and key.isascii():
        return key
    name = _KEYSYMS.get(key.lower() if len(key) > 1 else key)
    if name is None:
        raise ActionError("bad_parameters", f"unknown key {key!r} (pyautogui's names: enter, tab, ctrl, shift, alt, "
                                            "backspace, esc, up, f5, a, 1, ...)")
    return name


def xdotool_arguments(action: Action) -> list[str]:
    """The xdotool command line (chained commands) that performs `action`; [] for WAIT, DONE and FAIL. mousemove
    goes without --sync, which waits for the pointer to move and so never returns when it is already there; the
    server handles XTEST events in order, so a click after the move lands at the new point anyway."""
    p = action.parameters
    move = ["mousemove", str(p["x"]), str(p["y"])] if "x" in p else []
    kind = action.action_type
    if kind == "MOVE_TO":
        return move
    if kind == "CLICK":
        return [*move, "click", "--repeat", str(p.get("num_clicks", 1)), "--delay", str(CLICK_DELAY_MS),
                BUTTONS[p.get("button", "left")]]
    if kind in ("MOUSE_DOWN", "MOUSE_UP"):
        return ["mousedown" if kind == "MOUSE_DOWN" else "mouseup", BUTTONS[p.get("button", "left")]]
    if kind == "RIGHT_CLICK":
        return [*move, "click", "--delay", str(CLICK_DELAY_MS), "3"]
    if kind == "DOUBLE_CLICK":
        return [*move, "click", "--repeat", "2", "--delay", str(CLICK_DELAY_MS), "1"]
    if kind == "DRAG_TO":
        return ["mousedown", "1", "mousemove", str(p["x"]), str(p["y"]), "mouseup", "1"]
    if kind == "SCROLL":
        arguments = []
        if p["dy"]:
            arguments += ["click", "--repeat", str(abs(p["dy"])), "--delay", "0", "4" if p["dy"] > 0 else "5"]
        if p["dx"]:
            arguments += ["click", "--repeat", str(abs(p["dx"])), "--delay", "0", "7" if p["dx"] > 0 else "6"]
        return arguments
    if kind == "TYPING":
        return ["type", "--delay", "0", "--", p["text"]]
    if kind in ("PRESS", "KEY_DOWN", "KEY_UP"):
        verb = {"PRESS": "key", "KEY_DOWN": "keydown", "KEY_UP": "keyup"}[kind]
        return [verb, "--", keysym(p["key"])]
    if kind == "HOTKEY":
        return ["key", "--", "+".join(keysym(key) for key in p["keys"])]
    return []


def perform(action: Action, desktop: Desktop) -> None:
    """Run `action` on the desktop (nothing for WAIT, DONE and FAIL)."""
    arguments = xdotool_arguments(action)
    if arguments:
        desktop.xdotool(*arguments)
