// The bench's bundle: @toolmesh/assistant with its widget, everything exported.
export * from "../src/index.js";
export * from "../src/widget.js";
