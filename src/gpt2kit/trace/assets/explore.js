(function(){
'use strict';
var errs=document.getElementById('js-errors');
function report(msg){errs.textContent+=msg+'\n';}
window.addEventListener('error',function(e){report('error: '+e.message+' at '+(e.lineno||'?'));});
window.addEventListener('unhandledrejection',function(e){report('unhandled rejection: '+e.reason);});
var D=JSON.parse(document.getElementById('explore-data').textContent),C=D.config,S=GPT2Sampling;
function $(id){return document.getElementById(id);}
function el(tag,attrs,text){var e=document.createElement(tag);if(attrs)for(var k in attrs)e.setAttribute(k,attrs[k]);
  if(text!==undefined)e.textContent=text;return e;}
function show(s){return s.replace(/\n/g,'\u21b5').replace(/\t/g,'\u21e5');}
function num(x){if(typeof x==='string')return x==='-inf'?'\u2212\u221e':x;return Number(x).toPrecision(5);}
// each finished update counts up on <body data-NAME>, so a test (or you) can wait for it
function done(name){var b=document.body,k='data-'+name;b.setAttribute(k,String(+(b.getAttribute(k)||0)+1));}
function post(path,body){
  return fetch(path,{method:'POST',headers:{'Content-Type':'application/json'},body:JSON.stringify(body)})
    .then(function(r){return r.json().then(function(j){
      if(!r.ok){var m=j.error?j.error.message:JSON.stringify(j.detail||j);throw new Error(m);}return j;});});
}
function fail(e){var box=$('error');box.hidden=false;box.textContent=String(e.message||e);done('error');}
$('summary').textContent=(D.model?D.model+' \u2014 ':'')+C.n_layer+' blocks, '+C.n_head+' heads, C='+C.n_embd+
  ', context '+C.n_ctx+' tokens, vocabulary '+C.n_vocab+'. Everything runs on this machine; the page fetches '+
  'nothing from anywhere else.';
function fillSelect(sel,n,label){var keep=sel.value;sel.innerHTML='';
  for(var i=0;i<n;i++)sel.appendChild(el('option',{value:String(i)},label?label(i):String(i)));
  if(keep!==''&&+keep<n)sel.value=keep;}
fillSelect($('step-layer'),C.n_layer);fillSelect($('step-head'),C.n_head);
fillSelect($('iv-layer'),C.n_layer);fillSelect($('iv-head'),C.n_head);
$('iv-name').value='h.'+Math.floor(C.n_layer/2)+'.resid';

// --- the text and the views ---------------------------------------------------------------------
// The frame holds the report's page once; each text's views arrive as data and its script draws them
// (GPT2Report.render), the logit lens (most of the server's work) in a request of its own.
var text='',tokens=[],rows=4,cols=8,runs=0,stageRuns=0,frame=$('report');
var framed=new Promise(function(res){frame.onload=res;});
frame.srcdoc=D.views_page;
function fit(){try{frame.style.height=(frame.contentDocument.documentElement.scrollHeight+20)+'px';}
  catch(e){report('report: '+e);}}
var frameErrors=0;  // how much of the frame's error box has been passed on to this page's
function draw(fn){var w=frame.contentWindow;fn(w.GPT2Report);fit();
  var e=w.document.getElementById('js-errors').textContent;
  if(e.length>frameErrors){report('report: '+e.slice(frameErrors));frameErrors=e.length;}}
function run(){
  var mine=++runs;  // an older run's answer arriving after a newer one is dropped
  text=$('text').value;$('error').hidden=true;$('status').textContent='running\u2026';
  return Promise.all([post('/api/trace',{text:text}),framed]).then(function(got){
    var r=got[0];if(mine!==runs)return;
    tokens=r.tokens;$('count').textContent=r.ids.length+' of '+C.n_ctx+' tokens';
    draw(function(g){g.render(r.views);});done('report');
    fillSelect($('step-pos'),tokens.length,function(t){return t+' '+JSON.stringify(show(tokens[t]));});
    if(+$('step-pos').value!==tokens.length-1&&!stepPosChosen)$('step-pos').value=String(tokens.length-1);
    $('status').textContent='';done('trace');
    // the lens last: the server takes one request at a time, and the panels above wait for none of it
    return Promise.all([stages(),genStart(),intervene()]).then(function(){return lens(mine);});
  }).catch(fail);
}
function lens(mine){return post('/api/lens',{text:text}).then(function(r){
  if(mine!==runs)return;draw(function(g){g.lens(r);});done('lens');});}
var timer=null;
$('text').addEventListener('input',function(){clearTimeout(timer);timer=setTimeout(run,500);});
$('run').addEventListener('click',run);

// --- one block, stage by stage -----------------------------------------------------------------
var stepPosChosen=false;
function shapeText(s){return s.shape+' = ('+s.dims.join(', ')+')';}
function valuesTable(s){
  // "…" where columns are left out: before the first shown (the keys before a window) and after the last
  var t=el('table',{'class':'vals'}),h=el('tr'),before=s.cols[0]>0,after=s.cols[s.cols.length-1]<s.dims[s.dims.length-1]-1;
  h.appendChild(el('th',null,'t \\ col'));if(before)h.appendChild(el('th',null,'\u2026'));
  s.cols.forEach(function(c){h.appendChild(el('th',null,String(c)));});
  if(after)h.appendChild(el('th',null,'\u2026'));
  t.appendChild(h);
  s.values.forEach(function(row,i){var tr=el('tr');tr.appendChild(el('th',null,String(s.rows[i])));
    if(before)tr.appendChild(el('th'));
    row.forEach(function(x){tr.appendChild(el('td',null,num(x)));});if(after)tr.appendChild(el('th'));t.appendChild(tr);});
  return t;
}
var current=0;
function stages(){
  var body={text:text,layer:+$('step-layer').value,head:+$('step-head').value,position:+$('step-pos').value,
    rows:rows,cols:cols};
  var mine=++stageRuns;
  return post('/api/stages',body).then(function(r){
    if(mine!==stageRuns)return;
    var box=$('stages');box.innerHTML='';
    r.stages.forEach(function(s,i){
      var d=el('div',{'class':'stage',id:'stage-'+s.key,'data-key':s.key}),head=el('div',{'class':'head'});
      head.appendChild(el('b',null,(i+1)+'. '+s.title));
      head.appendChild(el('span',{'class':'fn'},'model.py: '+s.fn+'()'));
      head.appendChild(el('span',{'class':'shape'},shapeText(s)));
      head.addEventListener('click',function(){select(i);});
      d.appendChild(head);
      var more=el('div',{'class':'body'});more.appendChild(el('div',{'class':'help'},s.note));
      if(s.top){var t=el('table',{'class':'dist'});
        s.top.forEach(function(x){var tr=el('tr');tr.appendChild(el('td',{'class':'tk'},JSON.stringify(r.vocab[String(x[0])])));
          tr.appendChild(el('td',null,S.pct1(x[1])));t.appendChild(tr);});more.appendChild(t);}
      else{var w=el('div',{'class':'wrap'});w.appendChild(valuesTable(s));more.appendChild(w);}
      d.appendChild(more);box.appendChild(d);});
    select(Math.min(current,r.stages.length-1));
    done('stages');
  });
}
// one stage open at a time (all with "show every stage"); the arrows step through them
function select(i){var all=document.querySelectorAll('#stages .stage');if(!all.length)return;
  current=Math.max(0,Math.min(i,all.length-1));
  for(var j=0;j<all.length;j++)all[j].classList.toggle('cur',j===current);
  $('step-at').textContent='stage '+(current+1)+' of '+all.length;}
$('step-prev').addEventListener('click',function(){select(current-1);});
$('step-next').addEventListener('click',function(){select(current+1);});
$('step-all').addEventListener('change',function(){$('stages').classList.toggle('all',$('step-all').checked);});
['step-layer','step-head'].forEach(function(id){$(id).addEventListener('change',function(){stages().catch(fail);});});
$('step-pos').addEventListener('change',function(){stepPosChosen=true;stages().catch(fail);});
$('step-more').addEventListener('click',function(){rows=Math.min(rows*2,64);cols=Math.min(cols*2,64);stages().catch(fail);});

// --- generation on a KV cache ------------------------------------------------------------------
var widget=S.widget($('gen-widget'),'gen-'),gen=null;
function showGen(g){
  gen=g;var box=$('gen-context');box.innerHTML='';
  g.tokens.forEach(function(t,i){box.appendChild(el('span',{'class':i>=g.prompt_length?'new':'','data-id':String(g.ids[i])},show(t)));});
  var added=g.ids.length-g.prompt_length;
  $('gen-cache').textContent='KV cache: '+g.cache_length+' positions (the text\'s '+g.prompt_length+
    (added?' + '+added+' appended':'')+'). '+(added?'Each appended token was fed alone, at position = the cache '+
    'length; the keys and values of every earlier position were read from the cache, not recomputed. ':
    'The whole text was run once and its keys and values kept. ')+'The next token goes in at position '+
    g.cache_length+'.';
  widget.set(S.b64f32(g.logits),function(i){var s=g.vocab[String(i)];return s===undefined?'<'+i+'>':s;});
  done('gen');
}
function genStart(){return post('/api/gen/start',{text:text}).then(showGen);}
function append(mode){
  if(!gen)return;
  var s=widget.settings();
  post('/api/gen/append',{session:gen.session,mode:mode,temperature:s.temperature,top_k:s.top_k,top_p:s.top_p,
    min_p:s.min_p,seed:+$('seed').value}).then(showGen).catch(fail);
}
$('append-greedy').addEventListener('click',function(){append('greedy');});
$('append-sample').addEventListener('click',function(){append('sample');});
$('gen-use').addEventListener('click',function(){if(gen){$('text').value=gen.tokens.join('');run();}});

// --- interventions -----------------------------------------------------------------------------
function intervene(){
  var box=$('iv-out'),body={text:text,ablate:[],steer:null};
  if($('iv-ablate').checked)body.ablate.push('h.'+$('iv-layer').value+'.attn.head.'+$('iv-head').value);
  if($('iv-steer').checked)body.steer={name:$('iv-name').value,text:$('iv-text').value,scale:+$('iv-scale').value};
  if(!body.ablate.length&&!body.steer){box.textContent='Tick a change to compare.';done('iv');return Promise.resolve();}
  return post('/api/intervene',body).then(function(r){
    box.innerHTML='';box.appendChild(el('p',{'class':'help'},'changed: '+r.interventions.join('; ')+
      ' \u2014 KL(clean \u2016 changed) at the last position '+r.kl_last.toFixed(4)+' nats'));
    var t=el('table',{'class':'dist',id:'iv-table'}),h=el('tr');
    ['token','clean','changed'].forEach(function(x){h.appendChild(el('th',null,x));});t.appendChild(h);
    r.rows.forEach(function(x){var tr=el('tr');tr.appendChild(el('td',{'class':'tk'},JSON.stringify(r.vocab[String(x[0])])));
      tr.appendChild(el('td',null,S.pct1(x[1])));tr.appendChild(el('td',null,S.pct1(x[2])));t.appendChild(tr);});
    box.appendChild(t);done('iv');
  });
}
['iv-ablate','iv-steer','iv-layer','iv-head','iv-name','iv-text'].forEach(function(id){
  $(id).addEventListener('change',function(){intervene().catch(fail);});});
$('iv-scale').addEventListener('input',function(){$('iv-scale-value').textContent=$('iv-scale').value;});
$('iv-scale').addEventListener('change',function(){intervene().catch(fail);});

// --- the guided tour: each page points at the live view it explains -----------------------------
var TOUR=[
 ['Tokens','The model never sees letters: your text is cut into tokens (pieces of words, from a vocabulary of '+
  C.n_vocab+'), each one an id. The strip colours each token by how surprised the model was to see it there.','report:panel-tokens'],
 ['Embeddings and learned positions','Each token id picks a row of the embedding matrix wte (C = '+C.n_embd+
  ' numbers) and each position a row of wpe, the learned position embeddings; their sum is the residual stream '+
  'H\u2070 that every block reads and adds to.','stage-input'],
 ['The block','GPT-2 is '+C.n_layer+' identical blocks in a row. Each block reads the residual stream, computes '+
  'attention and then an MLP, and adds both results back to the stream. Pick a block, a head and a position here.','panel-step'],
 ['LayerNorm','Before attention the block normalises each position\'s vector: subtract its mean, divide by its '+
  'standard deviation, then scale and shift by learned g and b.','stage-ln_1.norm'],
 ['Queries, keys, values','One matrix product (c_attn) makes three vectors per position: a query, a key and a value, '+
  'then each is split into '+C.n_head+' heads of d_h = '+(C.n_embd/C.n_head)+' numbers.','stage-qkv'],
 ['Scores and the 1/\u221ad_h scale','Each query is compared with every key by a dot product; dividing by \u221ad_h '+
  'keeps the scores from growing with the head size, so the softmax does not saturate.','stage-scaled'],
 ['The causal mask','A position may only read from itself and earlier positions: the scores of later keys are '+
  'removed before the softmax. This is what makes GPT-2 a left-to-right language model.','stage-masked'],
 ['Attention patterns','The softmax turns each row of scores into weights that sum to 1. Every head of every block, '+
  'as a map: row = the reading position, column = the position read.','report:panel-heads'],
 ['Weighted values, heads merged','Each head mixes the values of the positions it attends to; the heads are put '+
  'side by side again and projected back to C numbers (c_proj), then added to the residual stream.','stage-merged'],
 ['The MLP','Per position, independently: widen to 4C, apply the tanh-GELU, project back to C. Most of the '+
  'parameters live here.','stage-mlp.post'],
 ['The residual stream','Nothing is replaced: each block adds its attention and MLP outputs. The stream\'s norm '+
  'grows from block to block.','report:panel-norms'],
 ['The final norm and the tied head','After the last block comes one more LayerNorm (ln_f), then the logits: a dot '+
  'product with every row of wte, the same matrix as the token embedding (tied).','stage-logits'],
 ['The logit lens','What would the model predict if it stopped after block l? Put each layer\'s residual stream '+
  'through ln_f and the tied head.','report:panel-lens'],
 ['Who pushed the prediction','The final logit is a sum of pieces: the embeddings, each head and each MLP, read '+
  'through ln_f. Direct logit attribution shows each piece\'s share.','report:panel-dla'],
 ['Sampling','The logits become probabilities with a softmax. Temperature sharpens or flattens them; top-k, top-p '+
  'and min-p cut the unlikely tail. Move the sliders: the numbers are recomputed in the page.','panel-gen'],
 ['The KV cache','Appending a token does not rerun the whole text: the keys and values of the earlier positions '+
  'are kept, and only the new token goes through the blocks, at position = the cache length.','gen-cache'],
 ['Interventions','Zero one head, or push the residual stream in a direction, and compare the distributions. '+
  'A big change means the model relied on it here.','panel-iv']];
var page=0,lit=null;
function tour(){var t=TOUR[page];$('tour-count').textContent='('+(page+1)+' of '+TOUR.length+')';
  $('tour-title').textContent=t[0];$('tour-text').textContent=t[1];}
function showTarget(){
  if(lit)lit.classList.remove('lit');
  var target=TOUR[page][2],node;
  if(target.indexOf('report:')===0){var f=$('report'),doc=f.contentDocument;
    node=doc&&doc.getElementById(target.slice(7));
    if(node){window.scrollTo(0,f.getBoundingClientRect().top+window.scrollY+node.offsetTop-8);}
    lit=null;return;}
  node=$(target);if(!node)return;
  if(node.classList.contains('stage'))select(Array.prototype.indexOf.call(node.parentNode.children,node));
  node.classList.add('lit');lit=node;node.scrollIntoView({block:'start'});
}
$('tour-prev').addEventListener('click',function(){page=Math.max(0,page-1);tour();});
$('tour-next').addEventListener('click',function(){page=Math.min(TOUR.length-1,page+1);tour();});
$('tour-show').addEventListener('click',showTarget);
tour();
run();
})();
