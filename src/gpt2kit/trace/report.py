"""The trace as data (`report_data`, what --json writes) and as one self-contained HTML file.

The HTML holds all its data and code inline: no src/href/import points anywhere, so it opens
offline in a browser, in Jupyter (Trace._repr_html_) and in VS Code's preview. Attention maps
travel as base64 uint8 (probability x 255), other numbers rounded to 5 significant digits;
the --json output keeps full precision.
"""

from __future__ import annotations

import base64
import html
import json
import math

import torch

from gpt2kit.trace import views

# The walk-through, in the spec's order: (name suffix, title, equation, note). {l} is the block.
_BLOCK_STEPS = [
    ("ln_1", "LN₁", "X̂ = LN₁(H<sup>(l−1)</sup>) = (H − μ) / σ · g₁ + b₁",
     "normalise each position's residual vector (μ, σ over its C numbers), then scale and shift"),
    ("attn.q", "queries", "Q = X̂ W<sub>q</sub> + b<sub>q</sub>  (split into heads)",
     "c_attn makes Q, K and V in one product; each head gets its own hs-wide slice"),
    ("attn.k", "keys", "K = X̂ W<sub>k</sub> + b<sub>k</sub>", ""),
    ("attn.v", "values", "V = X̂ W<sub>v</sub> + b<sub>v</sub>", ""),
    ("attn.scores", "scores", "S = Q Kᵀ / √d<sub>h</sub>,  S<sub>ij</sub> = −∞ for j &gt; i",
     "each query compares itself with every earlier key; the mask hides the future"),
    ("attn.probs", "attention", "P = softmax(S)  (each row sums to 1)", "how much position t reads from each key"),
    ("attn.z", "weighted values", "Z = P V", "per head, a mix of the values of the positions it attends to"),
    ("attn.out", "attention output", "A<sup>(l)</sup> = merge(Z) W<sub>proj</sub> + b<sub>proj</sub>",
     "the heads side by side, projected back to C"),
    ("resid_mid", "residual after attention", "H′ = H<sup>(l−1)</sup> + A<sup>(l)</sup>", "added, not replaced"),
    ("ln_2", "LN₂", "LN₂(H′)", ""),
    ("mlp.pre", "MLP pre-activation", "U = LN₂(H′) W<sub>fc</sub> + b<sub>fc</sub>", "width 4C"),
    ("mlp.post", "GELU", "G = 0.5 U (1 + tanh(√(2/π) (U + 0.044715 U³)))", "GPT-2's tanh GELU"),
    ("mlp.out", "MLP output", "M<sup>(l)</sup> = G W<sub>mproj</sub> + b<sub>mproj</sub>", "back to width C"),
]


def _round(x: float, digits: int = 5) -> float | None:
    if x is None or not math.isfinite(x):
        return None if x is None or math.isnan(x) else (1e30 if x > 0 else -1e30)
    return float(f"{x:.{digits}g}")


def _round_tree(obj, digits: int = 5):
    if isinstance(obj, float):
        return _round(obj, digits)
    if isinstance(obj, list):
        return [_round_tree(v, digits) for v in obj]
    if isinstance(obj, dict):
        return {k: _round_tree(v, digits) for k, v in obj.items()}
    return obj


def _row(t: torch.Tensor, n: int = 6) -> dict:
    """A few numbers of one row (the first n) and the row's norm; -inf (masked) becomes None."""
    t = t.float()
    vals = [float(v) if math.isfinite(float(v)) else None for v in t[:n]]
    finite = t[torch.isfinite(t)]
    return {"first": vals, "norm": float(finite.norm()), "n": t.numel()}


def walkthrough(tr, position: int) -> list[dict]:
    """The forward pass for this input in the spec's order, each step with its equation, shape and numbers."""
    T, cfg = len(tr.ids), tr.config
    steps: list[dict] = [{
        "block": None, "name": "ids", "title": "tokens", "eq": "X = (x<sub>1</sub>, …, x<sub>T</sub>)",
        "shape": [T], "note": f"{T} token ids; no token is added", "row": {"first": tr.ids[:6], "norm": None,
                                                                          "n": T}}]
    for name, title, eq, note in (
            ("embed.tok", "token embedding", "wte[X]", "row x<sub>t</sub> of wte, C numbers per token"),
            ("embed.pos", "position embedding", "wpe[pos],  pos = 0 … T−1", "row t of wpe"),
            ("resid.0", "residual stream", "H<sup>(0)</sup> = wte[X] + wpe[pos]", "the stream every block adds to")):
        if name in tr.tensors:
            steps.append({"block": None, "name": name, "title": title, "eq": eq, "note": note,
                          "shape": list(tr[name].shape), "row": _row(tr[name][position])})
    for i in range(cfg.n_layer):
        for suffix, title, eq, note in _BLOCK_STEPS:
            name = f"h.{i}.{suffix}"
            if name not in tr.tensors:
                continue
            t = tr[name]
            row = t[0, position] if t.dim() == 3 else t[position]  # head 0 for per-head tensors
            steps.append({"block": i, "name": name, "title": title + (" (head 0)" if t.dim() == 3 else ""),
                          "eq": eq.replace("(l)", f"({i + 1})").replace("(l−1)", f"({i})"), "note": note,
                          "shape": list(t.shape), "row": _row(row)})
        name = f"resid.{i + 1}"
        if name in tr.tensors:
            steps.append({"block": i, "name": name, "title": "residual after the block",
                          "eq": f"H<sup>({i + 1})</sup> = H′ + M<sup>({i + 1})</sup>", "note": "",
                          "shape": list(tr[name].shape), "row": _row(tr[name][position])})
    L = cfg.n_layer
    steps.append({"block": None, "name": "ln_f", "title": "final LayerNorm", "eq": f"LN<sub>f</sub>(H<sup>({L})</sup>)",
                  "note": "", "shape": list(tr["ln_f"].shape), "row": _row(tr["ln_f"][position])})
    logits = tr.logits[position].float()
    steps.append({"block": None, "name": "logits", "title": "logits",
                  "eq": f"logits = LN<sub>f</sub>(H<sup>({L})</sup>) wteᵀ", "note": "the tied head: no separate matrix",
                  "shape": list(tr.logits.shape), "row": _row(logits)})
    p, i = torch.softmax(logits, -1).topk(5)
    steps.append({"block": None, "name": "probs", "title": "next-token distribution", "eq": "softmax(logits)",
                  "note": "the five most likely next tokens", "shape": [cfg.n_vocab],
                  "top": [[int(a), float(b)] for a, b in zip(i, p, strict=True)]})
    return steps


def _attention(tr, encoding: str | None) -> dict | None:
    layers = [i for i in tr.layers if f"h.{i}.attn.probs" in tr.tensors]
    if not layers or encoding is None:
        return None
    P = torch.stack([tr[f"h.{i}.attn.probs"].float().cpu() for i in layers])  # (nL, nh, T, T)
    out = {"layers": layers, "shape": list(P.shape), "summary": tr.attention_summary()}
    if encoding == "list":
        out["probs"] = P.tolist()
    else:
        u8 = (P * 255).round().clamp(0, 255).to(torch.uint8).numpy().tobytes()
        out["u8"] = base64.b64encode(u8).decode("ascii")
    return out


def report_data(tr, *, attention_encoding: str | None = "list", position: int = -1) -> dict:
    """Everything the report shows, as plain JSON-able data."""
    cfg, T = tr.config, len(tr.ids)
    data: dict = {
        "model": tr.name, "config": {k: getattr(cfg, k) for k in ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer")},
        "ids": tr.ids, "tokens": tr.tokens, "shapes": {k: list(v) for k, v in tr.shapes().items()},
        "stats": tr.next_token_stats(), "lens": tr.logit_lens(k=5),
        "norms": {"layers": views.lens_layers(tr), "values": tr.residual_norms().tolist()},
        "attention": _attention(tr, attention_encoding), "walk": walkthrough(tr, position % T),
        "walk_position": position % T,
    }
    try:
        data["dla"] = tr.direct_logit_attribution()
    except ValueError as e:  # a partial selection: say why the panel is empty
        data["dla"] = {"unavailable": str(e)}
    data["patching"] = tr.patching.to_json() if tr.patching is not None else None
    used = set(tr.ids)
    for rows in data["stats"]["top_ids"]:
        used.update(rows)
    for layer in data["lens"]["top_ids"]:
        for rows in layer:
            used.update(rows)
    if "tokens" in data["dla"]:
        used.update(data["dla"]["tokens"])
    for step in data["walk"]:
        used.update(a for a, _ in step.get("top", []))
    if tr.patching is not None:
        used.update(t for t in (tr.patching.answer, tr.patching.foil) if t is not None)
    data["vocab"] = {str(i): _token_text(tr, i) for i in sorted(used)}
    return data


def _token_text(tr, i: int) -> str:
    return tr.tokenizer.decode([i]) if tr.tokenizer is not None else f"<{i}>"


def render_html(tr) -> str:
    data = _round_tree(report_data(tr, attention_encoding="u8"))
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=True).replace("</", "<\\/")
    title = html.escape(f"gpt2kit trace — {tr.name or 'model'} — {len(tr.ids)} tokens")
    return (_TEMPLATE.replace("__TITLE__", title).replace("__CSS__", _CSS).replace("__JS__", _JS)
            .replace("__DATA__", payload))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>__TITLE__</title><style>__CSS__</style></head>
<body>
<header><h1>__TITLE__</h1><p class="sub" id="summary"></p></header>
<pre id="js-errors"></pre>
<section id="panel-tokens" class="panel"><h2>Tokens, coloured by surprisal</h2>
<p class="help">Each token's colour is −log₂ p(token | the tokens before it) under the model: white is
expected, red is surprising. Hover a token for the model's top predictions at that point.</p>
<div id="strip"></div><div id="tip" class="tip"></div></section>
<section id="panel-heads" class="panel"><h2>Attention heads</h2>
<p class="help">Every head of every recorded block (rows: blocks, columns: heads). Row = query position,
column = key position, darker = more attention. Scores: <b>prev</b> mean attention to the previous token,
<b>first</b> to the first token, <b>ind</b> to the token after an earlier copy of the current one (induction).
Click a map to see it large.</p>
<div id="heads"></div><div id="head-detail"></div></section>
<section id="panel-lens" class="panel"><h2>Logit lens</h2>
<p class="help">Each layer's residual stream H<sup>(l)</sup> put through ln_f and the tied head, as if the
network stopped there: top token and its probability per layer × position. Shading: the probability
of the token that actually comes next.</p><div id="lens" class="scroll"></div></section>
<section id="panel-dla" class="panel"><h2>Direct logit attribution</h2>
<p class="help">How much each piece added to the residual stream contributes, through ln_f's scale at that
position, to the logit of the next token. The pieces sum to the logit.</p>
<label>position <select id="dla-pos"></select></label><div id="dla"></div></section>
<section id="panel-norms" class="panel"><h2>Residual stream norms</h2>
<p class="help">‖H<sup>(l)</sup><sub>t</sub>‖ per layer: the mean over positions (line) and every position (dots).</p>
<div id="norms"></div></section>
<section id="panel-patch" class="panel"><h2>Activation patching</h2><div id="patch"></div></section>
<section id="panel-walk" class="panel"><h2>The forward pass, step by step</h2>
<p class="help">GPT-2's forward pass for this input in the order of openai/gpt-2's model.py: each step's
equation, the shape of its tensor (one input, so no batch axis) and its first numbers at position
<span id="walk-pos"></span>. Per-head tensors show head 0.</p><div id="walk"></div></section>
<script type="application/json" id="trace-data">__DATA__</script>
<script>__JS__</script>
</body></html>
"""

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1200px;padding:12px;
color:#222;background:#fff}
h1{font-size:20px;margin:4px 0}h2{font-size:16px;margin:0 0 6px}.sub,.help{color:#555;margin:2px 0 8px}
.panel{border:1px solid #ddd;border-radius:6px;padding:10px 12px;margin:12px 0}
#js-errors:empty{display:none}#js-errors{color:#b00;background:#fee;padding:6px}
#strip{font:14px/2 ui-monospace,Menlo,Consolas,monospace}
.tok{white-space:pre;padding:2px 1px;border-radius:2px;cursor:default;border-right:1px solid #eee}
.tok:hover{outline:1px solid #333}
.tip{position:fixed;display:none;background:#fff;border:1px solid #888;padding:6px;font:12px ui-monospace,monospace;
box-shadow:0 2px 6px #0003;z-index:9;pointer-events:none;white-space:pre}
#heads{display:grid;gap:4px;overflow-x:auto}.hcell{text-align:center;font-size:10px;color:#444;cursor:pointer}
.hcell canvas{width:64px;height:64px;image-rendering:pixelated;border:1px solid #ccc;display:block;margin:0 auto}
.hcell.sel canvas{border-color:#d60}.rowlab{font-size:11px;align-self:center;color:#444}
#head-detail canvas{border:1px solid #ccc;margin-top:8px}
.scroll{overflow-x:auto}table.lens{border-collapse:collapse;font:11px ui-monospace,monospace}
table.lens td,table.lens th{border:1px solid #eee;padding:1px 3px;white-space:pre;max-width:70px;overflow:hidden}
table.lens th{background:#f6f6f6;font-weight:normal}
.bar{display:flex;align-items:center;font:11px ui-monospace,monospace;height:15px}
.bar .lab{width:150px;text-align:right;padding-right:6px}.bar .track{position:relative;width:520px;height:11px;
background:#f4f4f4}.bar .fill{position:absolute;top:0;height:11px}.bar .num{padding-left:6px}
.step{display:grid;grid-template-columns:190px 1fr;gap:2px 12px;padding:4px 0;border-top:1px solid #eee}
.step .t{font-weight:600}.step .eq{font-family:Georgia,serif}.step .nums{font:12px ui-monospace,monospace;color:#333}
.step .shape{font:12px ui-monospace,monospace;color:#07a}.step .note{color:#666;font-size:12px}
details{margin:4px 0}summary{cursor:pointer;font-weight:600}
"""

_JS = r"""
(function(){
'use strict';
var errs=document.getElementById('js-errors');
function report(msg){errs.textContent+=msg+'\n';}
window.addEventListener('error',function(e){report('error: '+e.message+' at '+(e.lineno||'?'));});
window.addEventListener('unhandledrejection',function(e){report('unhandled rejection: '+e.reason);});
var D=JSON.parse(document.getElementById('trace-data').textContent);
var T=D.ids.length;
function tok(i){var s=D.vocab[String(i)];return s===undefined?'<'+i+'>':s;}
function show(s){return s.replace(/\n/g,'\u21b5').replace(/\t/g,'\u21e5');}
function el(tag,attrs,text){var e=document.createElement(tag);if(attrs)for(var k in attrs)e.setAttribute(k,attrs[k]);
  if(text!==undefined)e.textContent=text;return e;}
function fmt(x,d){if(x===null||x===undefined)return '\u2013';if(Math.abs(x)>=1e29)return x>0?'+inf':'\u2212inf';
  return Number(x).toPrecision(d||4);}
function pct(p){return (100*p).toFixed(p<0.1?1:0)+'%';}
var tip=document.getElementById('tip');
function tipAt(e,text){tip.textContent=text;tip.style.display='block';
  tip.style.left=Math.min(e.clientX+12,window.innerWidth-320)+'px';tip.style.top=(e.clientY+14)+'px';}
function tipOff(){tip.style.display='none';}

function summary(){
  var c=D.config,s=D.stats.surprisal_bits,m=0;for(var i=0;i<s.length;i++)m+=s[i];
  document.getElementById('summary').textContent=(D.model?D.model+' \u2014 ':'')+'L='+c.n_layer+' layers, '+
    c.n_head+' heads, C='+c.n_embd+', V='+c.n_vocab+'; '+T+' tokens'+
    (s.length?'; mean surprisal '+(m/s.length).toFixed(2)+' bits/token':'');
}

function tokens(){
  var strip=document.getElementById('strip'),S=D.stats;
  for(var t=0;t<=T;t++){
    var last=(t===T),span=el('span',{'class':'tok'},last?' \u25b8 next':show(D.tokens[t]));
    var bits=(t>=1&&!last)?S.surprisal_bits[t-1]:null;
    if(bits!==null){var a=Math.min(bits/15,1);span.style.background='hsl(0,85%,'+(100-45*a)+'%)';}
    if(last)span.style.color='#07a';
    (function(t,bits,last){span.addEventListener('mousemove',function(e){
      var lines=[];
      if(t===0){lines.push('first token: nothing before it to predict it from');}
      else{var at=t-1;
        if(!last){lines.push('token '+t+': '+JSON.stringify(D.tokens[t])+'  id '+D.ids[t]);
          lines.push('log p = '+fmt(S.next_logprob[at])+' nats, surprisal '+fmt(bits,3)+' bits, rank '+S.next_rank[at]);}
        else lines.push('what the model predicts after the last token');
        lines.push('top predictions at this point:');
        for(var k=0;k<S.top_ids[at].length;k++)lines.push('  '+pct(S.top_probs[at][k]).padStart(6)+'  '+
          JSON.stringify(tok(S.top_ids[at][k])));}
      tipAt(e,lines.join('\n'));});
      span.addEventListener('mouseleave',tipOff);})(t,bits,last);
    strip.appendChild(span);
  }
}

function b64u8(s){var b=atob(s),a=new Uint8Array(b.length);for(var i=0;i<b.length;i++)a[i]=b.charCodeAt(i);return a;}
var ATT=null;
function attMap(li,h){var A=D.attention,n=A.shape[1],off=((li*n)+h)*T*T,out=new Float32Array(T*T);
  if(A.u8){for(var i=0;i<T*T;i++)out[i]=ATT[off+i]/255;}else{var m=A.probs[li][h];
    for(var q=0;q<T;q++)for(var k=0;k<T;k++)out[q*T+k]=m[q][k];}return out;}
function paint(canvas,m,cell){var ctx=canvas.getContext('2d'),img=ctx.createImageData(T,T);
  for(var i=0;i<T*T;i++){var v=m[i],j=4*i;img.data[j]=Math.round(255-215*v);img.data[j+1]=Math.round(255-170*v);
    img.data[j+2]=Math.round(255-60*v);img.data[j+3]=255;}
  if(!cell){ctx.putImageData(img,0,0);return;}
  var tmp=document.createElement('canvas');tmp.width=T;tmp.height=T;tmp.getContext('2d').putImageData(img,0,0);
  return tmp;}
function heads(){
  var box=document.getElementById('heads'),A=D.attention;
  if(!A){box.textContent='No attention probabilities were recorded (trace with what including probs).';return;}
  if(A.u8)ATT=b64u8(A.u8);
  var nL=A.shape[0],nh=A.shape[1],S=A.summary;
  box.style.gridTemplateColumns='40px repeat('+nh+',72px)';
  box.appendChild(el('div'));for(var h=0;h<nh;h++)box.appendChild(el('div',{'class':'rowlab'},'head '+h));
  for(var li=0;li<nL;li++){
    box.appendChild(el('div',{'class':'rowlab'},'L'+A.layers[li]));
    for(var h2=0;h2<nh;h2++){
      var cell=el('div',{'class':'hcell','data-layer':A.layers[li],'data-head':h2});
      var c=el('canvas',{width:T,height:T});paint(c,attMap(li,h2));cell.appendChild(c);
      var ind=S.induction[li]?S.induction[li][h2]:null;
      cell.appendChild(el('div',null,'p'+fmt(S.prev[li][h2],2)+' f'+fmt(S.first[li][h2],2)+
        (ind!==null?' i'+fmt(ind,2):'')));
      cell.title='block '+A.layers[li]+' head '+h2+': prev '+fmt(S.prev[li][h2],3)+', first '+fmt(S.first[li][h2],3)+
        ', induction '+(ind!==null?fmt(ind,3):'n/a (no repeated token)');
      (function(li,h,cell){cell.addEventListener('click',function(){big(li,h,cell);});})(li,h2,cell);
      box.appendChild(cell);}}
  big(nL-1,0,box.querySelector('.hcell'));
}
function big(li,h,cellEl){
  var A=D.attention,box=document.getElementById('head-detail');box.innerHTML='';
  var sel=document.querySelectorAll('.hcell.sel');for(var i=0;i<sel.length;i++)sel[i].classList.remove('sel');
  if(cellEl)cellEl.classList.add('sel');
  box.appendChild(el('div',{'class':'help'},'block '+A.layers[li]+', head '+h+' (rows: query, columns: key)'));
  var cell=Math.max(6,Math.min(18,Math.floor(640/T))),pad=110,n=T*cell;
  var c=el('canvas',{width:n+pad,height:n+pad,id:'head-big'}),ctx=c.getContext('2d'),m=attMap(li,h);
  ctx.fillStyle='#fff';ctx.fillRect(0,0,n+pad,n+pad);ctx.imageSmoothingEnabled=false;
  ctx.drawImage(paint(c,m,true),pad,pad,n,n);
  ctx.fillStyle='#333';ctx.font=Math.min(cell,12)+'px monospace';ctx.textBaseline='middle';
  for(var t=0;t<T;t++){var lab=show(D.tokens[t]).slice(0,12);ctx.textAlign='right';
    ctx.fillText(lab,pad-4,pad+t*cell+cell/2);ctx.save();ctx.translate(pad+t*cell+cell/2,pad-4);ctx.rotate(-Math.PI/2);
    ctx.textAlign='left';ctx.fillText(lab,0,0);ctx.restore();}
  c.addEventListener('mousemove',function(e){var r=c.getBoundingClientRect(),x=e.clientX-r.left-pad,y=e.clientY-r.top-pad;
    var k=Math.floor(x/cell),q=Math.floor(y/cell);if(k<0||q<0||k>=T||q>=T){tipOff();return;}
    tipAt(e,'query '+q+' '+JSON.stringify(D.tokens[q])+'\nkey '+k+' '+JSON.stringify(D.tokens[k])+'\np = '+fmt(m[q*T+k],4));});
  c.addEventListener('mouseleave',tipOff);
  box.appendChild(c);
}

function lens(){
  var Ls=D.lens,box=document.getElementById('lens'),tbl=el('table',{'class':'lens'}),hr=el('tr');
  hr.appendChild(el('th',null,'layer'));
  for(var t=0;t<T;t++)hr.appendChild(el('th',{title:'position '+t},show(D.tokens[t]).slice(0,8)));
  tbl.appendChild(hr);
  for(var r=Ls.layers.length-1;r>=0;r--){
    var tr=el('tr');tr.appendChild(el('th',null,Ls.layers[r]===D.config.n_layer?'H('+Ls.layers[r]+') out':'H('+Ls.layers[r]+')'));
    for(var t2=0;t2<T;t2++){
      var top=Ls.top_ids[r][t2][0],p=Ls.top_probs[r][t2][0],np=t2<T-1?Ls.next_prob[r][t2]:null;
      var td=el('td',null,show(tok(top)).slice(0,9)+' '+pct(p));
      if(np!==null)td.style.background='hsl(140,60%,'+(100-50*Math.min(1,np))+'%)';
      var lines=['layer '+Ls.layers[r]+', position '+t2];
      for(var k=0;k<Ls.top_ids[r][t2].length;k++)lines.push(pct(Ls.top_probs[r][t2][k])+' '+JSON.stringify(tok(Ls.top_ids[r][t2][k])));
      if(np!==null)lines.push('actual next '+JSON.stringify(D.tokens[t2+1])+': '+pct(np)+', rank '+Ls.next_rank[r][t2]);
      td.title=lines.join('\n');tr.appendChild(td);}
    tbl.appendChild(tr);}
  box.appendChild(tbl);
}

function dla(){
  var d=D.dla,box=document.getElementById('dla'),sel=document.getElementById('dla-pos');
  if(d.unavailable){box.textContent=d.unavailable;sel.disabled=true;return;}
  for(var t=0;t<T;t++){var o=el('option',{value:t},t+': '+show(D.tokens[t]).slice(0,16)+' \u2192 '+show(tok(d.tokens[t])).slice(0,16)+
    (t===T-1?' (top-1)':''));sel.appendChild(o);}
  sel.value=String(T-1);
  function draw(){
    var t=+sel.value,vals=d.values[t],labs=d.labels,L=D.config.n_layer,bars=[],heads=[];
    function v(name){var i=labs.indexOf(name);return i<0?0:vals[i];}
    bars.push(['embed.tok',v('embed.tok')],['embed.pos',v('embed.pos')]);
    for(var i=0;i<L;i++){var a=v('h.'+i+'.attn.bias');
      for(var j=0;j<labs.length;j++)if(labs[j].indexOf('h.'+i+'.attn.head.')===0){a+=vals[j];heads.push([labs[j],vals[j]]);}
      bars.push(['h.'+i+'.attn',a],['h.'+i+'.mlp',v('h.'+i+'.mlp')]);}
    bars.push(['ln_f.bias',v('ln_f.bias')]);
    heads.sort(function(x,y){return Math.abs(y[1])-Math.abs(x[1]);});
    box.innerHTML='';
    var sum=0;for(var s=0;s<vals.length;s++)sum+=vals[s];
    box.appendChild(el('p',{'class':'help'},'logit of '+JSON.stringify(tok(d.tokens[t]))+' at position '+t+' = '+fmt(d.logit[t],5)+
      ' (sum of the pieces: '+fmt(sum,5)+')'));
    var all=bars.concat([['\u2014 largest heads \u2014',null]],heads.slice(0,8));
    var mx=1e-9;for(var b=0;b<all.length;b++)if(all[b][1]!==null)mx=Math.max(mx,Math.abs(all[b][1]));
    for(var b2=0;b2<all.length;b2++){var row=el('div',{'class':'bar'});row.appendChild(el('span',{'class':'lab'},all[b2][0]));
      var tr=el('span',{'class':'track'});
      if(all[b2][1]!==null){var f=el('span',{'class':'fill'}),w=260*Math.abs(all[b2][1])/mx;
        f.style.width=w+'px';f.style.left=(all[b2][1]>=0?260:260-w)+'px';f.style.background=all[b2][1]>=0?'#3a7':'#c54';
        tr.appendChild(f);}
      row.appendChild(tr);row.appendChild(el('span',{'class':'num'},all[b2][1]===null?'':fmt(all[b2][1],3)));box.appendChild(row);}
  }
  sel.addEventListener('change',draw);draw();
}

function norms(){
  var N=D.norms,box=document.getElementById('norms'),W=620,H=240,pl=50,pb=30,nL=N.layers.length,mx=1e-9,out=[];
  for(var r=0;r<nL;r++)for(var t=0;t<T;t++)mx=Math.max(mx,N.values[r][t]);
  function X(r){return (pl+(W-pl-10)*(nL>1?r/(nL-1):0.5)).toFixed(1);}
  function Y(v){return (H-pb-(H-pb-10)*v/mx).toFixed(1);}
  out.push('<line x1="'+pl+'" y1="'+(H-pb)+'" x2="'+(W-10)+'" y2="'+(H-pb)+'" stroke="#999"/>');
  out.push('<line x1="'+pl+'" y1="10" x2="'+pl+'" y2="'+(H-pb)+'" stroke="#999"/>');
  var pts=[];
  for(var r2=0;r2<nL;r2++){var m=0;for(var t2=0;t2<T;t2++){m+=N.values[r2][t2];
      out.push('<circle cx="'+X(r2)+'" cy="'+Y(N.values[r2][t2])+'" r="1.6" fill="#9bd"/>');}
    m/=T;pts.push(X(r2)+','+Y(m));
    out.push('<text x="'+X(r2)+'" y="'+(H-pb+14)+'" font-size="10" text-anchor="middle">'+N.layers[r2]+'</text>');}
  out.push('<polyline points="'+pts.join(' ')+'" fill="none" stroke="#07a" stroke-width="2"/>');
  out.push('<text x="4" y="14" font-size="10">'+fmt(mx,3)+'</text>');
  out.push('<text x="'+(W/2)+'" y="'+(H-2)+'" font-size="11" text-anchor="middle">layer l of H(l)</text>');
  box.innerHTML='<svg width="'+W+'" height="'+H+'" viewBox="0 0 '+W+' '+H+'">'+out.join('')+'</svg>';
}

function patch(){
  var P=D.patching,box=document.getElementById('patch');
  if(!P){box.appendChild(el('p',{'class':'help'},'No comparison text was given (gpt2kit trace --compare TEXT, or trace(..., patch_from=...)).'));return;}
  box.appendChild(el('p',{'class':'help'},'The compared text runs with one residual vector H(l)[p] taken from this text '+
    '(rows: layer l, columns: position p). Colour: the fraction of the logit difference '+JSON.stringify(tok(P.answer))+
    (P.foil!==null?' \u2212 '+JSON.stringify(tok(P.foil)):'')+' at the last position that the patch restores (clean '+
    fmt(P.clean_metric,4)+', compared '+fmt(P.corrupt_metric,4)+'). Blank: the two runs agree there.'));
  var tbl=el('table',{'class':'lens',id:'patch-grid'}),hr=el('tr');hr.appendChild(el('th',null,'layer'));
  for(var t=0;t<T;t++)hr.appendChild(el('th',null,show(D.tokens[t]).slice(0,8)+(D.tokens[t]!==P.corrupt_tokens[t]?
    '/'+show(P.corrupt_tokens[t]).slice(0,8):'')));
  tbl.appendChild(hr);
  for(var r=P.layers.length-1;r>=0;r--){var tr=el('tr');tr.appendChild(el('th',null,'H('+P.layers[r]+')'));
    for(var t2=0;t2<T;t2++){var v=P.restored[r][t2],td=el('td',null,v===null?'':fmt(v,2));
      if(v!==null){var a=Math.max(-1,Math.min(1,v));td.style.background=a>=0?'hsl(270,60%,'+(100-50*a)+'%)':'hsl(30,80%,'+(100+40*a)+'%)';}
      td.title='layer '+P.layers[r]+', position '+t2+': metric '+fmt(P.metric[r][t2],4);tr.appendChild(td);}
    tbl.appendChild(tr);}
  var wrap=el('div',{'class':'scroll'});wrap.appendChild(tbl);box.appendChild(wrap);
}

function walk(){
  var box=document.getElementById('walk'),cur=null,block=-2;
  document.getElementById('walk-pos').textContent=D.walk_position+' ('+JSON.stringify(D.tokens[D.walk_position])+')';
  for(var i=0;i<D.walk.length;i++){var s=D.walk[i];
    if(s.block!==block){block=s.block;
      if(s.block===null){cur=box;}
      else{var det=el('details');if(s.block===0)det.open=true;
        det.appendChild(el('summary',null,'block '+s.block+' (h.'+s.block+')'));box.appendChild(det);cur=det;}}
    var row=el('div',{'class':'step','data-name':s.name});
    row.appendChild(el('div',{'class':'t'},s.title));
    var eq=el('div',{'class':'eq'});eq.innerHTML=s.eq;row.appendChild(eq);
    row.appendChild(el('div',{'class':'shape'},s.name+'  ('+s.shape.join(', ')+')'));
    var nums;
    if(s.top){nums=s.top.map(function(x){return JSON.stringify(tok(x[0]))+' '+pct(x[1]);}).join('   ');}
    else{nums='['+s.row.first.map(function(x){return s.name==='ids'?String(x):fmt(x,4);}).join(', ')+(s.row.n>s.row.first.length?', \u2026':'')+']'+
      (s.row.norm!==null?'   \u2016row\u2016 = '+fmt(s.row.norm,4):'');}
    row.appendChild(el('div',{'class':'nums'},nums));
    if(s.note){var n=el('div',{'class':'note'});n.innerHTML=s.note;row.appendChild(el('div'));row.appendChild(n);}
    cur.appendChild(row);}
}

var panels=[['summary',summary],['tokens',tokens],['heads',heads],['lens',lens],['dla',dla],['norms',norms],
  ['patch',patch],['walk',walk]];
for(var i=0;i<panels.length;i++){try{panels[i][1]();}catch(e){report(panels[i][0]+': '+(e&&e.stack||e));}}
document.body.setAttribute('data-rendered',errs.textContent?'with-errors':'ok');
})();
"""
