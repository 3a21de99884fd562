// A user mistake (a bad feed, a missing or tampered file, a dag.json this runtime cannot run):
// one message that names the input, output, file or CU, as the Python runtime's CortexError does.
export class CortexError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = "CortexError";
  }
}

/** Python's repr of a name, so that messages read the same in both runtimes. @param {string} name */
export function quoted(name) {
  return `'${name}'`;
}
