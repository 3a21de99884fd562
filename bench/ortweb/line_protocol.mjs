// The benches' runners speak one protocol with their Python side: one JSON request per stdin line
// ({"cmd": ..., ...}), one JSON reply per stdout line ({"ok": true, ...} or {"ok": false, "error"}).
import readline from "node:readline";

export async function serveLines(handlers) {
  const lines = readline.createInterface({ input: process.stdin });
  for await (const line of lines) {
    if (!line.trim()) continue;
    const req = JSON.parse(line);
    if (req.cmd === "quit") break;
    let reply;
    try {
      reply = { ok: true, ...(await handlers[req.cmd](req)) };
    } catch (e) {
      reply = { ok: false, error: String(e && e.message || e).split("\n")[0] };
    }
    process.stdout.write(JSON.stringify(reply) + "\n");
  }
  process.exit(0);
}
