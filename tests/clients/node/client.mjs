// node client.mjs URL JSON_BODY  ->  prints {"status", "contentType", "body", "reads"} as JSON.
// A POST with Node's built-in fetch; the body is read incrementally (SSE streams arrive in pieces).
const [url, body] = process.argv.slice(2);
const r = await fetch(url, {
  method: 'POST',
  headers: { 'content-type': 'application/json', authorization: 'Bearer sk-node-agent' },
  body,
  signal: AbortSignal.timeout(20000),
});
const decoder = new TextDecoder();
let text = '';
let reads = 0;
for await (const piece of r.body) {
  text += decoder.decode(piece, { stream: true });
  reads += 1;
}
text += decoder.decode();
process.stdout.write(JSON.stringify({
  status: r.status, contentType: r.headers.get('content-type'), body: text, reads,
}));
