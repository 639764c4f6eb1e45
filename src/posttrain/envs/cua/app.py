"""The bundled desktop app of the computer-use tasks: a small contact form in Tk, run as its own program on the
episode's Xvfb display (`python app.py --workdir DIR`; it imports nothing of posttrain, so it starts in a blink).

The form has a Name and an Email entry, a Subscribe check box, a Category list (Personal, Work, Family), a Notes
entry, a Save button that writes the form to WORKDIR/contact.json (and says "Saved" in the status line) and a Clear
button. `--initial-state FILE` fills the form from such a JSON file before it shows.

Accessibility tree: Tk exposes no AT-SPI, so the app describes its own widgets. It listens on the Unix socket in
Linux's abstract namespace named by `--socket NAME` (no file, so no limit from a long work directory path, and
nothing left behind); a client sends one line, `tree`, and gets one JSON line back: a list of nodes, each {role,
name, text, states, x, y, width, height} with screen coordinates. This is the app's own introspection, not what an
accessibility bus would report for a real desktop (OSWorld reads AT-SPI through pyatspi).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tkinter as tk
from pathlib import Path

CATEGORIES = ("Personal", "Work", "Family")
STATE_FILE = "contact.json"
WINDOW = (420, 330)
"""Width and height of the app's window, placed at the screen's top-left corner (Xvfb runs no window manager)."""


class ContactForm:
    def __init__(self, root: tk.Tk, workdir: Path, initial: dict):
        self.root, self.workdir = root, workdir
        root.title("Contact form")
        root.geometry(f"{WINDOW[0]}x{WINDOW[1]}+0+0")
        self.name = tk.StringVar(value=initial.get("name", ""))
        self.email = tk.StringVar(value=initial.get("email", ""))
        self.notes = tk.StringVar(value=initial.get("notes", ""))
        self.subscribe = tk.BooleanVar(value=bool(initial.get("subscribe", False)))
        self.status = tk.StringVar(value="")
        self.labels: dict[tk.Widget, str] = {}
        row = 0
        for label, variable in (("Name", self.name), ("Email", self.email)):
            tk.Label(root, text=label).grid(row=row, column=0, sticky="w", padx=8, pady=4)
            entry = tk.Entry(root, textvariable=variable, width=30)
            entry.grid(row=row, column=1, sticky="w", padx=8, pady=4)
            self.labels[entry] = label
            row += 1
        self.check = tk.Checkbutton(root, text="Subscribe", variable=self.subscribe)
        self.check.grid(row=row, column=1, sticky="w", padx=8, pady=4)
        row += 1
        tk.Label(root, text="Category").grid(row=row, column=0, sticky="nw", padx=8, pady=4)
        self.category = tk.Listbox(root, height=len(CATEGORIES), exportselection=False)
        for item in CATEGORIES:
            self.category.insert("end", item)
        if initial.get("category") in CATEGORIES:
            self.category.selection_set(CATEGORIES.index(initial["category"]))
        self.category.grid(row=row, column=1, sticky="w", padx=8, pady=4)
        self.labels[self.category] = "Category"
        row += 1
        tk.Label(root, text="Notes").grid(row=row, column=0, sticky="w", padx=8, pady=4)
        notes = tk.Entry(root, textvariable=self.notes, width=30)
        notes.grid(row=row, column=1, sticky="w", padx=8, pady=4)
        self.labels[notes] = "Notes"
        row += 1
        buttons = tk.Frame(root)
        buttons.grid(row=row, column=1, sticky="w", padx=8, pady=8)
        tk.Button(buttons, text="Save", command=self.save).pack(side="left")
        tk.Button(buttons, text="Clear", command=self.clear).pack(side="left", padx=8)
        row += 1
        tk.Label(root, textvariable=self.status).grid(row=row, column=1, sticky="w", padx=8)

    def state(self) -> dict:
        selected = self.category.curselection()
        return {"name": self.name.get(), "email": self.email.get(), "subscribe": self.subscribe.get(),
                "category": CATEGORIES[selected[0]] if selected else None, "notes": self.notes.get()}

    def save(self) -> None:
        path = self.workdir / STATE_FILE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.state(), indent=1) + "\n", encoding="utf-8")
        os.replace(temporary, path)
        self.status.set("Saved")

    def clear(self) -> None:
        for variable in (self.name, self.email, self.notes):
            variable.set("")
        self.subscribe.set(False)
        self.category.selection_clear(0, "end")
        self.status.set("")

    def tree(self) -> list[dict]:
        """Every visible widget, depth first, as {role, name, text, states, x, y, width, height}."""
        nodes: list[dict] = []
        focused = self.root.focus_get()

        def visit(widget: tk.Misc) -> None:
            node = self._node(widget, focused)
            if node is not None:
                nodes.append(node)
            for child in widget.winfo_children():
                visit(child)

        visit(self.root)
        return nodes

    def _node(self, widget: tk.Misc, focused: tk.Misc | None) -> dict | None:
        if not widget.winfo_viewable():
            return None
        states = ["focused"] if widget is focused else []
        if isinstance(widget, tk.Tk):
            role, name, text = "frame", widget.title(), ""
        elif isinstance(widget, tk.Frame):
            return None  # layout only
        elif isinstance(widget, tk.Checkbutton):
            role, name, text = "check box", widget.cget("text"), ""
            states.append("checked" if self.subscribe.get() else "unchecked")
        elif isinstance(widget, tk.Button):
            role, name, text = "push button", widget.cget("text"), ""
        elif isinstance(widget, tk.Label):
            if str(widget.cget("textvariable")):
                role, name, text = "label", "Status", self.status.get()
            else:
                role, name, text = "label", widget.cget("text"), ""
        elif isinstance(widget, tk.Entry):
            role, name, text = "entry", self.labels.get(widget, ""), widget.get()
        elif isinstance(widget, tk.Listbox):
            selected = widget.curselection()
            role, name = "list", self.labels.get(widget, "")
            text = widget.get(selected[0]) if selected else ""
            nodes = [self._base(widget, role, name, text, states)]
            for index in range(widget.size()):
                box = widget.bbox(index)
                if box is None:
                    continue
                item_states = ["selected"] if index in selected else []
                nodes.append({"role": "list item", "name": widget.get(index), "text": "", "states": item_states,
                              "x": widget.winfo_rootx() + box[0], "y": widget.winfo_rooty() + box[1],
                              "width": box[2], "height": box[3]})
            return {"group": nodes}
        else:
            return None
        return self._base(widget, role, name, text, states)

    @staticmethod
    def _base(widget: tk.Misc, role: str, name: str, text: str, states: list[str]) -> dict:
        return {"role": role, "name": name, "text": text, "states": states, "x": widget.winfo_rootx(),
                "y": widget.winfo_rooty(), "width": widget.winfo_width(), "height": widget.winfo_height()}


def _flatten(nodes: list[dict]) -> list[dict]:
    return [leaf for node in nodes for leaf in (node["group"] if "group" in node else [node])]


def serve(form: ContactForm, server: socket.socket) -> None:
    """Answer waiting tree requests, then look again in 10 ms (Tk is single-threaded: no thread touches it)."""
    while True:
        try:
            connection, _ = server.accept()
        except BlockingIOError:
            break
        with connection:
            connection.settimeout(2.0)
            request = b""
            try:
                while not request.endswith(b"\n"):
                    chunk = connection.recv(4096)
                    if not chunk:
                        break
                    request += chunk
                if request.strip() == b"tree":
                    form.root.update()  # handle the input events already queued first
                    answer = {"nodes": _flatten(form.tree())}
                else:
                    answer = {"error": f"unknown request {request.strip()[:80]!r}; send 'tree'"}
                connection.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                pass  # the client went away; it has its own deadline
    form.root.after(10, serve, form, server)


def main() -> None:
    parser = argparse.ArgumentParser(description="The computer-use tasks' contact form.")
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--socket", required=True, help="the abstract Unix socket's name (without the leading NUL)")
    parser.add_argument("--initial-state", type=Path)
    args = parser.parse_args()
    initial = json.loads(args.initial_state.read_text(encoding="utf-8")) if args.initial_state else {}
    root = tk.Tk()
    form = ContactForm(root, args.workdir, initial)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + args.socket)
    server.listen(4)
    server.setblocking(False)
    root.after(10, serve, form, server)
    root.mainloop()


if __name__ == "__main__":
    main()
