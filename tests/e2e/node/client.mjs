// A cascade.v1 client in another language, for the conformance suite (tests/e2e/node_client.py).
//
//   node client.mjs <host:port> <prompt_token_ids comma-separated> <max_new_tokens>
//
// Loads protos/cascade/v1/cascade.proto as it is (no generated code), runs a fixed set of calls over an
// insecure channel and prints ONE JSON object on stdout. A call that fails is recorded, not thrown:
// the script exits 0 whenever it ran to the end, and non-zero only if it crashed itself. The Python
// side makes the assertions.
//
// Written for old Node too (no top-level await, no ?. or ??): .ci/run may get Node from apt.

import path from 'path';
import { fileURLToPath } from 'url';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO_ROOT = path.resolve(HERE, '..', '..', '..');
const DEADLINE_MS = 120 * 1000;
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

function loadPackage(includeDir, file) {
  const definition = protoLoader.loadSync(file, Object.assign({ includeDirs: [includeDir] }, LOADER_OPTIONS));
  return grpc.loadPackageDefinition(definition);
}

function deadline() {
  return { deadline: Date.now() + DEADLINE_MS };
}

// The rich error model's trailer (a serialized google.rpc.Status), base64, or null when absent.
function statusDetailsBin(metadata) {
  if (!metadata || typeof metadata.get !== 'function') {
    return null;
  }
  const values = metadata.get('grpc-status-details-bin');
  if (!values || values.length === 0) {
    return null;
  }
  return Buffer.from(values[0]).toString('base64');
}

function describeError(err) {
  return {
    code: typeof err.code === 'number' ? err.code : null,
    details: typeof err.details === 'string' ? err.details : String(err.message),
    status_details_bin: statusDetailsBin(err.metadata),
  };
}

function unary(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, deadline(), (err, response) => {
      resolve(err ? { error: err } : { response: response });
    });
  });
}

// Collects a server stream. grpc-js ends a failed stream with an 'error' event (a ServiceError with
// code, details and the trailers as .metadata) followed by a 'status' event (code, details,
// metadata); an OK stream gets 'end' and 'status'. Wait for the status and, on success, for 'end'
// too, so that no chunk still buffered in the Readable is missed.
function serverStream(client, method, request) {
  return new Promise((resolve) => {
    const chunks = [];
    let error = null;
    let status = null;
    let ended = false;
    let done = false;
    const finish = () => {
      if (!done && status !== null && (ended || error !== null || status.code !== grpc.status.OK)) {
        done = true;
        resolve({ chunks: chunks, error: error, status: status });
      }
    };
    const call = client[method](request, deadline());
    call.on('data', (chunk) => chunks.push(chunk));
    call.on('error', (err) => { error = err; finish(); });
    call.on('status', (st) => { status = st; finish(); });
    call.on('end', () => { ended = true; finish(); });
  });
}

function errorResult(err) {
  return { error: describeError(err) };
}

async function main() {
  const argv = process.argv.slice(2);
  if (argv.length !== 3) {
    process.stderr.write('usage: node client.mjs <host:port> <prompt_token_ids comma-separated> <max_new_tokens>\n');
    process.exit(2);
  }
  const address = argv[0];
  const prompt = argv[1].split(',').filter((s) => s.trim() !== '').map((s) => {
    const n = Number(s);
    if (!Number.isInteger(n)) {
      throw new Error('not a token id: ' + JSON.stringify(s));
    }
    return n;
  });
  const maxNewTokens = Number(argv[2]);

  const cascade = loadPackage(path.join(REPO_ROOT, 'protos'), 'cascade/v1/cascade.proto');
  const healthPkg = loadPackage(HERE, 'health.proto');
  const credentials = grpc.credentials.createInsecure();
  const client = new cascade.cascade.v1.CascadeService(address, credentials);
  const health = new healthPkg.grpc.health.v1.Health(address, credentials);

  const request = { prompt_token_ids: prompt, max_new_tokens: maxNewTokens, temperature: 0 };
  const badRequest = { prompt_token_ids: prompt, max_new_tokens: 0, temperature: 0 };
  const out = {};

  // generate: one unary call.
  {
    const r = await unary(client, 'Generate', request);
    if (r.error) {
      out.generate = errorResult(r.error);
    } else {
      const resp = r.response;
      out.generate = {
        token_ids: resp.token_ids.map(Number),
        finish_reason: resp.finish_reason,
        generated_tokens: resp.stats ? resp.stats.generated_tokens : null, // a string: longs: String
        session_length: resp.session_length,
      };
    }
  }

  // stream: the same request, streamed.
  {
    const r = await serverStream(client, 'GenerateStream', request);
    const tokenIds = [];
    for (const chunk of r.chunks) {
      for (const t of chunk.token_ids) {
        tokenIds.push(Number(t));
      }
    }
    out.stream = {
      token_ids: tokenIds,
      chunks: r.chunks.length,
      finish_reason: r.chunks.length > 0 ? r.chunks[r.chunks.length - 1].finish_reason : null,
      status_code: r.status ? r.status.code : null,
    };
    if (r.error) {
      out.stream.error = describeError(r.error);
    }
  }

  // seeded: one sampled request three times, its seed as a string (a uint64 as protobufjs takes it) and as a
  // number: a seed fixes a sampled output, whatever the server drafted in between.
  {
    out.seeded = [];
    for (const seed of ['42', '42', 42]) {
      const r = await unary(client, 'Generate', {
        prompt_token_ids: prompt,
        max_new_tokens: maxNewTokens,
        temperature: 1,
        seed: seed,
      });
      out.seeded.push(r.error ? errorResult(r.error) : r.response.token_ids.map(Number));
    }
  }

  // bad_unary / bad_stream: max_new_tokens 0 is INVALID_ARGUMENT.
  {
    const r = await unary(client, 'Generate', badRequest);
    out.bad_unary = r.error
      ? describeError(r.error)
      : { code: 0, details: '', status_details_bin: null, unexpected_response: true };
  }
  {
    const r = await serverStream(client, 'GenerateStream', badRequest);
    if (r.error) {
      out.bad_stream = describeError(r.error);
    } else {
      out.bad_stream = {
        code: r.status ? r.status.code : null,
        details: r.status ? r.status.details : '',
        status_details_bin: null,
        no_error_event: true,
      };
    }
    out.bad_stream.chunks = r.chunks.length;
    // The 'status' event as well, so the suite can check that both views agree.
    out.bad_stream.status_event = r.status
      ? { code: r.status.code, details: r.status.details, status_details_bin: statusDetailsBin(r.status.metadata) }
      : null;
  }

  // not_found: an unknown session.
  {
    const r = await unary(client, 'GetSession', { session_id: 'no-such-session' });
    out.not_found = r.error
      ? describeError(r.error)
      : { code: 0, details: '', status_details_bin: null, unexpected_response: true };
  }

  // health: grpc.health.v1.Health/Check for the whole server.
  {
    const r = await unary(health, 'Check', { service: '' });
    out.health = r.error ? errorResult(r.error) : r.response.status;
  }

  client.close();
  health.close();
  process.stdout.write(JSON.stringify(out) + '\n');
}

main().catch((err) => {
  process.stderr.write((err && err.stack ? err.stack : String(err)) + '\n');
  process.exit(1);
});
